"""Pre-flight agreement: ranks started with different settings all stop before the model is built, naming every
difference and which ranks hold which value (megatron.guards.preflight)."""
import json
import os
import sys

from megatron.spawn import free_port, run_distributed

from tests.helpers import REPO
from tests import warm_python


TINY = ["--mock-data", "--num-layers", "1", "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64",
        "--make-vocab-size-divisible-by", "8", "--train-iters", "2", "--eval-iters", "0"]


def _initialize(per_rank_args):
    """initialize_megatron with this rank's arguments; returns the PreflightError text (None when they agree)."""
    import torch.distributed as dist
    from megatron.initialize import initialize_megatron
    from megatron.guards.preflight import PreflightError
    try:
        initialize_megatron(args_list=TINY + per_rank_args[dist.get_rank()])
    except PreflightError as error:
        return str(error)
    return None


def test_agreeing_ranks_pass():
    assert run_distributed(_initialize, 2, args=([["--hidden-size", "32"]] * 2,)) == [None, None]


def test_different_hidden_size_and_seed_stop_every_rank_naming_both_values():
    errors = run_distributed(_initialize, 2, args=([["--hidden-size", "32", "--seed", "1"],
                                                    ["--hidden-size", "64", "--seed", "2"]],))
    for error in errors:
        assert error == ("ranks disagree before training: hidden_size: 32 on ranks [0], 64 on ranks [1]; "
                         "seed: 1 on ranks [0], 2 on ranks [1]"), error


def test_only_the_documented_per_process_keys_are_left_out_of_the_digest(tmp_path):
    """Every argument is in the digest except rank, local_rank, the parsed config object (its content is, as
    zero_config.*) and the config file's path; the seed is in it."""
    from megatron.guards import preflight
    from megatron.arguments import parse_args
    args = parse_args(args_list=TINY + ["--hidden-size", "32", "--seed", "1", "--deepspeed", "--deepspeed_config",
                                        _config(str(tmp_path), "ds.json", 2)])
    args.rank = 0                                  # set when torch.distributed is joined (initialize.py)
    digest = preflight.compute_digest(args)
    assert set(vars(args)) - set(digest) == {"rank", "local_rank", "zero_config", "deepspeed_config"}
    assert digest["seed"] == "1" and digest["zero_config.zero_optimization.stage"] == "2"


def test_a_key_on_one_rank_only_is_reported_by_name():
    """differences() takes the union of every rank's keys: a key absent from rank 0's digest (or any other) is
    reported with '<absent>' for the ranks that lack it."""
    from megatron.guards import preflight
    same = {"hidden_size": "32", "seed": "1"}
    found = preflight.differences([same, dict(same, only_here="x"), dict(same), dict(same, only_here="x")])
    assert found == [("only_here", {"<absent>": [0, 2], "x": [1, 3]})]
    assert preflight.describe(found) == "ranks disagree before training: only_here: <absent> on ranks [0, 2], x on " \
                                        "ranks [1, 3]"
    found = preflight.differences([dict(same, only_rank_0="y"), dict(same)])
    assert found == [("only_rank_0", {"y": [0], "<absent>": [1]})]
    assert preflight.differences([same, dict(same)]) == []


def _config(directory, name, stage):
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": stage}}, handle)
    return path


def test_different_json_config_stops_every_rank(tmp_path):
    same = [["--deepspeed", "--deepspeed_config", _config(str(tmp_path), f"same{r}.json", 2)] for r in range(2)]
    assert run_distributed(_initialize, 2, args=(same,)) == [None, None]   # another path, same content: agree
    differ = [["--deepspeed", "--deepspeed_config", _config(str(tmp_path), f"ds{r}.json", 1 + r)] for r in range(2)]
    errors = run_distributed(_initialize, 2, args=(differ,))
    for error in errors:
        assert "zero_config.zero_optimization.stage: 1 on ranks [0], 2 on ranks [1]" in error, error
        assert "deepspeed_config" not in error.replace("zero_config", ""), error   # paths are per-process


def test_digest_names_changed_source_file():
    from megatron.guards import preflight
    digest = preflight.source_digest()
    assert "source:pretrain_gpt.py" in digest and "source:megatron/guards/preflight.py" in digest
    assert any(key.startswith("source:mpu/") for key in digest)
    other = dict(digest, **{"source:megatron/training.py": "0" * 16})
    found = preflight.differences([digest, other, digest])
    assert [key for key, _ in found] == ["source:megatron/training.py"]
    assert found[0][1][digest["source:megatron/training.py"]] == [0, 2]


WRAPPER = """
import os, sys
sys.path.insert(0, {repo!r})
rank = int(os.environ["RANK"])
sys.argv += ["--hidden-size", "32" if rank == 0 else "64"]
import runpy
runpy.run_path(os.path.join({repo!r}, "pretrain_gpt.py"), run_name="__main__")
"""


def test_cli_ranks_with_different_flags_exit_nonzero_with_one_line(tmp_path):
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER.format(repo=REPO))
    result = warm_python.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(free_port()), str(wrapper)] + TINY, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    line = "error: ranks disagree before training: hidden_size: 32 on ranks [0], 64 on ranks [1]"
    assert result.stderr.count(line) == 2, result.stderr[-3000:]
    assert "PreflightError" not in result.stderr, result.stderr[-3000:]   # one line each, no worker traceback
