"""Crash-consistent training under torchrun restarts (issue 24, item 1): a rank SIGKILLed in the middle of an
optimizer step or in the middle of writing a checkpoint; torchrun (c10d rendezvous, --max-restarts 1) restarts the
group, which resumes from the newest complete checkpoint in --save. The final weights, optimizer state and RNG
states are bitwise those of an uninterrupted run, and so is every logged loss (fp32, dropout on), on the Megatron
path and on ZeRO-2 and ZeRO-3."""
import json
import os
import re
import sys

import pytest
import torch

from megatron.spawn import free_port, run_distributed
from tests.helpers import assert_bitwise, MOCK_VOCAB, REPO, TINY_SHAPE, train
from tests import warm_python

ITERS = 8
MODEL = MOCK_VOCAB + TINY_SHAPE + ["--batch-size", "2", "--train-iters", str(ITERS), "--log-interval", "1",
         "--eval-iters", "0", "--save-interval", "3", "--lr", "1e-3", "--warmup", "0", "--seed", "7"]
PATHS = {"megatron": [], "zero2": ["zero2"], "zero3": ["zero3"]}


def _path_args(path, directory):
    if path == "megatron":
        return []
    config = os.path.join(directory, f"{path}.json")
    with open(config, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": int(path[-1]), "reduce_bucket_size": 4000,
                                         "allgather_bucket_size": 4000,
                                         "stage3_param_persistence_threshold": 0}}, handle)
    return ["--deepspeed", "--deepspeed_config", config]


def _torchrun(save, path, kill=None, flags=MODEL):
    """torchrun (2 ranks, one restart allowed) of pretrain_gpt.py on `flags`, with a SIGKILL (`kill`: (KILL_AT,
    rank)) injected by tests/fixtures/kill_once.py; {iteration: the logged loss} (flags log every iteration)."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    if kill is not None:
        env.update(KILL_AT=kill[0], KILL_RANK=str(kill[1]), KILL_MARKER=save + ".killed")
    script = os.path.join(REPO, "tests", "fixtures", "kill_once.py") if kill else "pretrain_gpt.py"
    env.setdefault("KILL_AT", "step:0")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", script, *flags,
               *_path_args(path, os.path.dirname(save)), "--save", save, "--load", save]
    result = warm_python.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    if kill is not None:
        assert os.path.exists(save + ".killed"), "the kill was never triggered"
        assert "loaded checkpoint" in result.stdout, result.stdout[-3000:]
    losses = {}
    for iteration, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|", result.stdout):
        losses[int(iteration)] = float(loss)    # the restarted attempt's value wins (it is logged last)
    return losses, result.stdout


def _final_tensors(save, iteration=ITERS):
    tag = f"iter_{iteration:07d}"
    out = {}
    for root, _, files in os.walk(os.path.join(save, tag)):
        for name in files:
            if name.endswith(".pt"):
                out[os.path.relpath(os.path.join(root, name), save)] = torch.load(
                    os.path.join(root, name), map_location="cpu", weights_only=False)
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted references: the same flags on 2 in-process gloo workers (no torchrun needed for a run
    nothing kills); each loss as the restarted run's log prints it (%E, 7 significant digits)."""
    runs = {}
    for path in PATHS:
        save = str(tmp_path_factory.mktemp(f"straight_{path}") / "save")
        argv = MODEL + _path_args(path, os.path.dirname(save)) + ["--save", save, "--load", save]
        history = run_distributed(train, 2, args=(argv,))[0]
        assert history["iteration"] == list(range(1, ITERS + 1))
        losses = {i: float(f"{loss:E}") for i, loss in zip(history["iteration"], history["lm loss"])}
        runs[path] = (losses, _final_tensors(save))
    return runs


@pytest.mark.parametrize("path,kill", [
    ("megatron", ("step:5", 1)), ("megatron", ("save:6", 0)), ("zero2", ("step:5", 1)), ("zero3", ("save:6", 1)),
], ids=["megatron-mid-step", "megatron-mid-save", "zero2-mid-step", "zero3-mid-save"])
def test_a_killed_rank_restarts_and_ends_bitwise_equal(straight, tmp_path, path, kill):
    save = str(tmp_path / "save")
    losses, stdout = _torchrun(save, path, kill)
    reference_losses, reference_tensors = straight[path]
    assert losses == reference_losses
    assert "loaded checkpoint from" in stdout and " at iteration 3" in stdout   # the newest complete one
    final = _final_tensors(save)
    assert final.keys() == reference_tensors.keys()
    assert_bitwise(reference_tensors, final)
