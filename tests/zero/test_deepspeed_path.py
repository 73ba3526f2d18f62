"""The --deepspeed path (ZeRO engine inside Megatron's loop): equals the Megatron path; config agreement;
both ds_* scripts on CPU, including two torchrun "nodes" on this machine."""
import json
import os
import re
import subprocess
import sys
import threading

import pytest


from megatron.spawn import free_port, run_distributed
from tests.helpers import (logged_losses, NO_DROPOUT, parser_error, REPO, run_script, SCRIPT_TEST_DS_CONFIG,
                           SCRIPT_TEST_SHAPE, script_env, set_tracker, SHORT_PRETRAIN, TINY, train, write_config)
from tests.checkpoint.test_checkpoint import train_killed_in_save
from tests import warm_python


def test_zero2_path_equals_megatron_path_at_mp2_dp2(tmp_path):
    config = write_config(str(tmp_path))
    common = TINY + NO_DROPOUT + ["--model-parallel-size", "2"]
    megatron = run_distributed(train, 4, args=(common + ["--batch-size", "2"],))[0]["lm loss"]
    zero2 = run_distributed(train, 4, args=(common + ["--deepspeed", "--deepspeed_config", config],))[0]["lm loss"]
    assert len(zero2) == 10
    assert max(abs(a - b) for a, b in zip(megatron, zero2)) <= 1e-5, (megatron, zero2)


def _run_cli(flags, env=None):
    return warm_python.run([sys.executable, "pretrain_gpt.py", "--mock-data"] + flags, cwd=REPO,
                           env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=120)


def _parse_error(argv, capsys):
    """pretrain_gpt.py's parser on `argv` (in-process): the one line it prints, after checking it exits with 2."""
    from megatron.arguments import parse_args
    return parser_error(lambda flags: parse_args(args_list=["--mock-data"] + flags), argv, capsys)


def test_config_that_disagrees_with_command_line_stops(tmp_path, capsys):
    config = write_config(str(tmp_path))
    line = _parse_error(["--deepspeed", "--deepspeed_config", config, "--batch-size", "8"], capsys)
    assert "--batch-size (8) disagrees with train_micro_batch_size_per_gpu (2)" in line
    line = _parse_error(["--deepspeed", "--deepspeed_config", config, "--fp16"], capsys)
    assert "--fp16 (True) disagrees with fp16.enabled (False)" in line


def test_missing_or_broken_config_stops(tmp_path, capsys):
    line = _parse_error(["--deepspeed", "--deepspeed_config", str(tmp_path / "nope.json")], capsys)
    assert "nope.json" in line and "does not exist" in line
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 2}}')
    assert "zero_optimization" in _parse_error(["--deepspeed", "--deepspeed_config", str(broken)], capsys)
    assert "--deepspeed_config" in _parse_error(["--deepspeed"], capsys)


def test_micro_batch_count_is_the_engines_accumulation(tmp_path):
    """Under --deepspeed the number of micro-batches per step is the JSON's gradient_accumulation_steps (derived
    here from train_batch_size 12 / micro 2 at dp 1 = 6), whatever the flags' defaults would give; without it,
    --global-batch-size / (--batch-size x dp)."""
    from megatron.arguments import parse_args
    config = write_config(str(tmp_path), train_batch_size=12)
    raw = json.load(open(config))
    del raw["gradient_accumulation_steps"]
    json.dump(raw, open(config, "w"))
    args = parse_args(args_list=["--mock-data", "--deepspeed", "--deepspeed_config", config])
    assert args.zero_config.gradient_accumulation_steps == 6 and args.num_micro_batches == 6
    assert (args.batch_size, args.global_batch_size) == (2, 12)
    args = parse_args(args_list=["--mock-data", "--batch-size", "3", "--global-batch-size", "15"])
    assert args.num_micro_batches == 5 and args.zero_config is None


SHORT = SHORT_PRETRAIN


def test_ds_pretrain_gpt_sh(ds_pretrained):
    """`make pretrain`'s two steps: train through ZeRO-2 (validation and test-split perplexity at the end; the
    session's ds_pretrained run) ending with the plot of its log, named; then a greedy continuation of a fixed
    prompt from the checkpoint."""
    checkpoint, stdout = ds_pretrained
    losses = logged_losses(stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses
    assert re.search(r"validation loss at the end of training for test data \| lm loss value: \S+ \| lm loss PPL", stdout)
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert stdout.splitlines()[-1] == \
        f"plot: {checkpoint}/run.png and {checkpoint}/run.html (from {checkpoint}/log.jsonl)", stdout[-2000:]
    assert (checkpoint / "run.png").stat().st_size > 10_000 and "<svg" in (checkpoint / "run.html").read_text()
    stdout = run_script("generate_text.sh", dict(SHORT, CHECKPOINT_PATH=str(checkpoint), OUT_SEQ_LENGTH="4"))
    assert "Context: Return the number of" in stdout and stdout.count("Megatron-LM:") == 2, stdout
    assert "sampled continuation (top-p 0.9, seed 1234):" in stdout, stdout
    # the second continuation is sampled: a 20-step model's next-token distribution is nearly flat, so top-p 0.9
    # (seed 1234) leaves the argmax path within 4 tokens
    greedy, sampled = re.findall(r"^Megatron-LM:(.*?)(?=^greedy continuation|^sampled continuation|\Z)", stdout,
                                 re.S | re.M)
    assert greedy.strip() != sampled.strip(), stdout


def test_ds_pretrain_gpt_sh_takes_a_muon_json_with_its_own_lr_and_schedule(tmp_path, webtext_data):
    """A DeepSpeed-typical Muon JSON (lr 0.02, weight_decay, betas, a WarmupLR) through the script: the recipe's
    defaults (--lr, its cosine schedule, --weight-decay, --adam-beta2 0.95) give way, the run follows the JSON's
    schedule (linear warmup 0 -> 0.02 over 2 steps: the log line's lr after steps 1 and 2, 0 and 0.01); an LR the
    user sets still disagrees with it by name."""
    with open(SCRIPT_TEST_DS_CONFIG) as handle:
        config = json.load(handle)
    config["train_micro_batch_size_per_gpu"] = 2
    config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                                                      "betas": [0.9, 0.98]}}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02,
                                                          "warmup_num_steps": 2, "warmup_type": "linear"}}
    path = tmp_path / "muon.json"
    path.write_text(json.dumps(config))
    env = dict(SCRIPT_TEST_SHAPE, HIDDEN_SIZE="64", SEQ_LENGTH="32", DS_CONFIG=str(path), TRAIN_ITERS="2", LOG_INTERVAL="1", EVAL_ITERS="0",
               CHECKPOINT_PATH=str(tmp_path / "ckpt"), LOG_JSONL="")
    stdout = run_script("ds_pretrain_gpt.sh", env)
    assert [float(lr) for lr in re.findall(r"\| learning rate: (\S+) \|", stdout)] == [0.0, 0.01], stdout[-3000:]
    refused = subprocess.run(["bash", "scripts/ds_pretrain_gpt.sh"], cwd=REPO, capture_output=True, text=True,
                             env=script_env(dict(env, LR="0.002")), timeout=300)
    assert refused.returncode != 0
    assert "--lr (0.002) disagrees with scheduler.params.warmup_max_lr (0.02)" in refused.stderr, refused.stderr


def test_ds_zero2_model_parallel_sh_two_nodes(tmp_path, webtext_data):
    """Two torchrun invocations (--nnodes 2) against 127.0.0.1, 2 processes each: mp 2 x dp 2. (The script's
    one-node launch, 2 processes, runs in test_zero3's test_ds_script_runs_the_zero3_offload_config.)"""
    port = str(free_port())
    env = dict(SHORT, GPUS_PER_NODE="2", MP_SIZE="2", NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    outputs = {}

    def node(rank):
        full_env = dict(os.environ, NODE_RANK=str(rank), **env)
        outputs[rank] = subprocess.run(["bash", "scripts/ds_zero2_pretrain_gpt_model_parallel.sh"], cwd=REPO,
                                       env=full_env, capture_output=True, text=True, timeout=600)
    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank in (0, 1):
        errors = [line for line in outputs[rank].stderr.splitlines() if not line.startswith("W1")]
        assert outputs[rank].returncode == 0, (f"node {rank} failed; stdout:\n{outputs[rank].stdout[-2000:]}\n"
                                               "stderr:\n" + "\n".join(errors[-60:]))
    assert "world size 4: model-parallel 2 x data-parallel 2" in outputs[0].stdout
    losses = logged_losses(outputs[0].stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses


# Where `args.deepspeed` may branch: the functions the DeepSpeed-Megatron tutorial changes.
DEEPSPEED_BRANCHES_ALLOWED = {
    "megatron/training.py": {"get_model", "get_optimizer", "setup_model_and_optimizer", "backward_step",
                             "train_step", "train"},
    "megatron/arguments.py": {"validate_args"},
    "megatron/model/providers.py": {"set_deepspeed_activation_checkpointing"}}   # pretrain_gpt.py's, moved (issue 56)
NOT_SCANNED = {"tests", "data"}      # top-level folders without library code (hidden folders are skipped too)
DEEPSPEED_BRANCH = re.compile(r"args(\(\))?\.deepspeed\b|getattr\(\s*\w*args(\(\))?\s*,\s*[\"']deepspeed[\"']")


def deepspeed_branches(repo):
    """{path relative to `repo`: top-level functions with a line reading `args.deepspeed`, `get_args().deepspeed`
    or `getattr(args, "deepspeed")`} over the .py files outside NOT_SCANNED. Folders are compared as path
    components relative to `repo`, so where the checkout lives (/data/..., .../tests/...) does not matter."""
    found = {}
    for root, dirs, files in os.walk(repo):
        top = os.path.relpath(root, repo) == "."
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (top and d in NOT_SCANNED)]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.relpath(os.path.join(root, name), repo).replace(os.sep, "/")
            function = None
            for line in open(os.path.join(root, name)):
                match = re.match(r"def (\w+)", line)
                if match:
                    function = match.group(1)
                if DEEPSPEED_BRANCH.search(line):
                    found.setdefault(path, set()).add(function)
    return found


def misplaced_branches(found):
    """[(path, [functions])] of `found` outside DEEPSPEED_BRANCHES_ALLOWED, by path."""
    misplaced = []
    for path, functions in sorted(found.items()):
        outside = functions - DEEPSPEED_BRANCHES_ALLOWED.get(path, set())
        if outside:
            misplaced.append((path, sorted(outside)))
    return misplaced


def test_deepspeed_branches_only_at_the_tutorials_places():
    """`args.deepspeed` appears only in the functions the DeepSpeed-Megatron tutorial changes."""
    found = deepspeed_branches(REPO)
    assert "megatron/training.py" in found          # the scan sees the real branches (it is not vacuous)
    assert misplaced_branches(found) == []


def _plant(repo, path, text):
    path = repo / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_deepspeed_branch_scan_does_not_depend_on_where_the_checkout_lives(tmp_path):
    """A checkout under .../data/tests/...: the planted branches in library folders (megatron/data among them)
    are found in every spelling; the top-level tests/ and data/ and hidden folders are not scanned; a
    `--deepspeed_config` read is not a branch."""
    repo = tmp_path / "data" / "tests" / "checkout"
    _plant(repo, "megatron/model/planted.py", "import os\n\n\ndef build(args):\n    if args.deepspeed:\n        pass\n")
    _plant(repo, "megatron/data/planted.py", "def load():\n    return get_args().deepspeed\n")
    _plant(repo, "tools/planted.py", "def f(args):\n    return getattr(args, 'deepspeed', False)\n")
    _plant(repo, "megatron/training.py", "def train_step():\n    if get_args().deepspeed:\n        pass\n")
    _plant(repo, "megatron/quiet.py", "def g(args):\n    return args.deepspeed_config\n")
    for ignored in ("tests/test_x.py", "data/tool.py", ".venv/lib/site.py"):
        _plant(repo, ignored, "def h(args):\n    return args.deepspeed\n")
    found = deepspeed_branches(str(repo))
    assert found == {"megatron/model/planted.py": {"build"}, "megatron/data/planted.py": {"load"},
                     "tools/planted.py": {"f"}, "megatron/training.py": {"train_step"}}
    assert misplaced_branches(found) == [("megatron/data/planted.py", ["load"]),
                                         ("megatron/model/planted.py", ["build"]), ("tools/planted.py", ["f"])]


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RESUME = TINY[:TINY.index("--train-iters")] + ["--train-iters", "6", "--log-interval", "100", "--eval-iters", "0",
                                                  "--lr", "1e-3", "--warmup", "0", "--seed", "7"]


def test_zero_checkpoint_resume_is_exact(tmp_path):
    """6 straight steps == 3 + save_ds_checkpoint + fresh processes + load + 3, bitwise, dropout on (mp1 x dp2)."""
    zero_args = ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path))]
    save_dir = str(tmp_path / "ckpt")
    straight = run_distributed(train, 2, args=(RESUME + DROPOUT + zero_args + ["--save", save_dir,
                                                                              "--save-interval", "3"],))
    assert sorted(os.listdir(os.path.join(save_dir, "iter_0000003"))) == [
        "manifest.json", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert open(os.path.join(save_dir, "latest")).read() == "iter_0000006"
    set_tracker(save_dir, 3)
    resumed = run_distributed(train, 2, args=(RESUME + DROPOUT + zero_args + ["--load", save_dir],))
    for s, r in zip(straight, resumed):
        assert r["iteration"] == [4, 5, 6]
        assert r["lm loss"] == s["lm loss"][3:] and r["lr"] == s["lr"][3:]

    # Killed in the middle of saving iteration 4 (files written, not yet renamed): iteration 3 stays the
    # checkpoint that `latest` and the tracker name, and the run resumes from it exactly; keep-last prunes.
    run_dir = str(tmp_path / "killed")
    args = RESUME + DROPOUT + zero_args + ["--save", run_dir, "--save-interval", "1", "--save-keep-last", "2"]
    with pytest.raises(RuntimeError, match="exited with code -9|failed"):
        run_distributed(train_killed_in_save, 2, args=(args, 4))
    assert open(os.path.join(run_dir, "latest")).read() == "iter_0000003"
    assert open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")).read() == "3"
    assert sorted(os.listdir(run_dir)) == ["iter_0000002", "iter_0000003", "iter_0000004.tmp", "latest",
                                           "latest_checkpointed_iteration.txt"]
    resumed = run_distributed(train, 2, args=(args + ["--load", run_dir],))
    assert resumed[0]["iteration"] == [4, 5, 6] and resumed[0]["lm loss"] == straight[0]["lm loss"][3:]
    assert sorted(os.listdir(run_dir)) == ["iter_0000005", "iter_0000006", "latest",
                                           "latest_checkpointed_iteration.txt"]


def test_zero_checkpoint_resumes_at_another_data_parallel_size(tmp_path):
    """Saved at mp2 x dp2 (4 processes), resumed at mp2 x dp1 (2 processes, accumulation 2): same global batch,
    losses within 1e-5 of the uninterrupted 4-process run (dropout off: the dropout streams depend on the layout)."""
    config = write_config(str(tmp_path), train_batch_size=4)
    del_accumulation = json.load(open(config))
    del del_accumulation["gradient_accumulation_steps"]
    json.dump(del_accumulation, open(config, "w"))
    zero_args = ["--deepspeed", "--deepspeed_config", config, "--model-parallel-size", "2"]
    save_dir = str(tmp_path / "ckpt")
    straight = run_distributed(train, 4, args=(RESUME + NO_DROPOUT + zero_args + ["--save", save_dir,
                                                                                 "--save-interval", "3"],))[0]
    set_tracker(save_dir, 3)
    resumed = run_distributed(train, 2, args=(RESUME + NO_DROPOUT + zero_args + ["--load", save_dir],))[0]
    assert resumed["iteration"] == [4, 5, 6]
    assert max(abs(a - b) for a, b in zip(resumed["lm loss"], straight["lm loss"][3:])) <= 1e-5


def test_checkpoint_of_the_other_path_loads(tmp_path):
    """A Megatron-path checkpoint loads with --deepspeed and a ZeRO checkpoint without it (resharded, one line)."""
    tiny = TINY[:TINY.index("--train-iters")] + ["--train-iters", "1", "--eval-iters", "0", "--batch-size", "2"]
    zero_args = ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path))]
    env = {"MASTER_PORT": str(free_port())}
    megatron_dir, zero_dir = str(tmp_path / "megatron"), str(tmp_path / "zero")
    run_distributed(train, 1, args=(tiny + ["--save", megatron_dir],))     # the saves: in-process workers
    run_distributed(train, 1, args=(tiny + zero_args + ["--save", zero_dir],))
    more = ["--train-iters", "2", "--override-lr-scheduler"]
    result = _run_cli(tiny[1:] + zero_args + more + ["--load", megatron_dir], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resharding checkpoint saved at mp1 (megatron) for mp1 x dp1 (zero-2)" in result.stdout
    result = _run_cli(tiny[1:] + more + ["--load", zero_dir], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resharding checkpoint saved at mp1 x dp1 (zero-2) for mp1 x dp1 (megatron)" in result.stdout