"""The --deepspeed path (ZeRO engine inside Megatron's loop): equals the Megatron path; config agreement;
both ds_* scripts on CPU, including two torchrun "nodes" on this machine."""
import json
import os
import re
import subprocess
import sys
import threading

import pytest

from tests.distributed import free_port, run_distributed
from tests.scripts_util import REPO, logged_losses, run_script
from tests.test_training import NO_DROPOUT, TINY, _train


def write_config(directory, **overrides):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": 5000, "allgather_bucket_size": 5000}}
    config.update(overrides)
    path = os.path.join(directory, "ds_config.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


def test_zero2_path_equals_megatron_path_at_mp2_dp2(tmp_path):
    config = write_config(str(tmp_path))
    common = TINY + NO_DROPOUT + ["--model-parallel-size", "2"]
    megatron = run_distributed(_train, 4, args=(common + ["--batch-size", "2"],))[0]["lm loss"]
    zero2 = run_distributed(_train, 4, args=(common + ["--deepspeed", "--deepspeed_config", config],))[0]["lm loss"]
    assert len(zero2) == 10
    assert max(abs(a - b) for a, b in zip(megatron, zero2)) <= 1e-5, (megatron, zero2)


def _run_cli(flags, env=None):
    return subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data"] + flags, cwd=REPO,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=120)


def test_config_that_disagrees_with_command_line_stops(tmp_path):
    config = write_config(str(tmp_path))
    result = _run_cli(["--deepspeed", "--deepspeed_config", config, "--batch-size", "8"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--batch-size (8) disagrees with train_micro_batch_size_per_gpu (2)" in result.stderr
    result = _run_cli(["--deepspeed", "--deepspeed_config", config, "--fp16"])
    assert result.returncode == 2 and "--fp16 (True) disagrees with fp16.enabled (False)" in result.stderr


def test_missing_or_broken_config_stops(tmp_path):
    result = _run_cli(["--deepspeed", "--deepspeed_config", str(tmp_path / "nope.json")])
    assert result.returncode == 2 and "nope.json" in result.stderr and "does not exist" in result.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 2}}')
    result = _run_cli(["--deepspeed", "--deepspeed_config", str(broken)])
    assert result.returncode == 2 and "zero_optimization" in result.stderr and "Traceback" not in result.stderr
    result = _run_cli(["--deepspeed"])
    assert result.returncode == 2 and "--deepspeed_config" in result.stderr


SHORT = {"TRAIN_ITERS": "20", "LOG_INTERVAL": "5", "EVAL_INTERVAL": "10", "EVAL_ITERS": "2", "SEQ_LENGTH": "64"}


def test_ds_pretrain_gpt_sh(tmp_path):
    stdout = run_script("ds_pretrain_gpt.sh", dict(SHORT, CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    losses = logged_losses(stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses


def test_ds_zero2_model_parallel_sh_four_processes(tmp_path):
    stdout = run_script("ds_zero2_pretrain_gpt_model_parallel.sh",
                        dict(SHORT, GPUS_PER_NODE="4", MP_SIZE="2", CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    assert "model-parallel 2 x data-parallel 2" in stdout
    losses = logged_losses(stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses


def test_ds_zero2_model_parallel_sh_two_nodes(tmp_path):
    """Two torchrun invocations (--nnodes 2) against 127.0.0.1, 2 processes each: mp 2 x dp 2."""
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
        assert outputs[rank].returncode == 0, outputs[rank].stderr[-3000:]
    assert "world size 4: model-parallel 2 x data-parallel 2" in outputs[0].stdout
    losses = logged_losses(outputs[0].stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses


def test_deepspeed_branches_only_at_the_tutorials_places():
    """`args.deepspeed` appears only in the functions the DeepSpeed-Megatron tutorial changes."""
    allowed = {"megatron/training.py": {"get_model", "get_optimizer", "setup_model_and_optimizer", "backward_step",
                                        "train_step", "train"},
               "megatron/utils.py": {"save_checkpoint", "load_checkpoint"},
               "megatron/arguments.py": {"validate_args"},
               "pretrain_gpt.py": {"set_deepspeed_activation_checkpointing"}}
    found = {}
    for root, _, files in os.walk(REPO):
        if any(part in root for part in (".venv", ".git", "tests", "data")):
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.relpath(os.path.join(root, name), REPO)
            function = None
            for line in open(os.path.join(root, name)):
                match = re.match(r"def (\w+)", line)
                if match:
                    function = match.group(1)
                if re.search(r"args\.deepspeed\b", line):
                    found.setdefault(path, set()).add(function)
    for path, functions in found.items():
        assert path in allowed and functions <= allowed[path], (path, functions)
