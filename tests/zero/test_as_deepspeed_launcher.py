"""`python -m megatron.zero.as_deepspeed` takes DeepSpeed's launcher command line (issue 53 row 8): a
DeepSpeed-Chat-shaped main (tests/fixtures/ds_chat_shaped_main.py, which starts torch.distributed only when given
--local_rank) runs unchanged through our launcher and through DeepSpeed 0.19.8's own launcher with
`--module megatron.zero.as_deepspeed`; both train it as plain torch AdamW on the global batch does."""
import importlib.util
import json
import os
import sys

import pytest
import torch

from megatron.spawn import free_port
from megatron.zero.as_deepspeed import __main__ as alias_module
from megatron.zero.as_deepspeed.__main__ import main as alias_main
from tests.helpers import FIXTURES, REPO, script_env
from tests import warm_python

CLIENT = os.path.join(FIXTURES, "ds_chat_shaped_main.py")
STEPS, MICRO, LR, WORLD = 4, 2, 1e-2, 2            # the client's
TOLERANCE = 1e-5


def _reference():
    """Plain torch: the client's model and global batches, AdamW on the mean over all ranks' rows; per step the
    loss of each rank's rows before the update."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)
        x = torch.randn(MICRO * WORLD, 8, generator=generator)
        y = torch.sin(x[:, :4] * 2)
        out = model(x)
        for rank in range(WORLD):
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            losses[rank].append(torch.nn.functional.mse_loss(out[rows], y[rows]).item())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(out, y).backward()
        optimizer.step()
    return losses, model.state_dict()


def _launch(command, output_dir):
    result = warm_python.run([sys.executable, *command, "--output_dir", str(output_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=300,
                             env=script_env({"PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu"}))
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    records = []
    for rank in range(WORLD):
        with open(os.path.join(output_dir, f"result_rank{rank}.json")) as handle:
            records.append(json.load(handle))
    return records


def _check_trained(records):
    losses, weights = _reference()
    assert [(r["rank"], r["world"], r["local_rank"]) for r in records] == [(0, 2, 0), (1, 2, 1)]
    for record in records:
        assert max(abs(a - b) for a, b in zip(record["losses"], losses[record["rank"]])) <= TOLERANCE
        for name, value in weights.items():
            assert (torch.tensor(record["weights"][name]) - value).abs().max().item() <= TOLERANCE, name


def test_our_launcher_passes_local_rank_as_deepspeeds_does(tmp_path):
    """`deepspeed --num_gpus 2 main.py`, spelt with our alias: two processes, each given --local_rank=N."""
    _check_trained(_launch(["-m", "megatron.zero.as_deepspeed", "--num_gpus", "2", "--master_port",
                            str(free_port()), CLIENT], tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is a test requirement")
def test_deepspeeds_launcher_runs_the_alias_as_its_module(tmp_path):
    """DeepSpeed's launcher puts --local_rank=N before the script: the alias passes it on, not as the script."""
    _check_trained(_launch(["-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                            str(free_port()), "--module", "megatron.zero.as_deepspeed", CLIENT], tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--include", "worker-1:0", "main.py"], "--include worker-1:0: host 'worker-1' is not this node; ssh launch "
                                             "is not done here"),
    (["--num_gpus", "2", "--include", "localhost:0", "main.py"], "--num_gpus with --include/--exclude: give one"),
    (["--local_rank=0", "--num_gpus", "2", "main.py"], "--num_gpus starts processes: give it to the first command"),
    (["--no_python", "main.py"], "--no_python: the client runs in Python here"),
    (["--num_nodes", "2", "main.py"], "--num_nodes 2: run the command on each node with --node_rank R and "
                                      "--master_addr NODE0"),
    (["--exclude", "localhost:0", "main.py"], "--exclude localhost:0 leaves no device"),
])
def test_bad_launcher_options_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        alias_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_num_gpus_under_torchrun_is_refused(capsys, monkeypatch):
    """Under torchrun (LOCAL_RANK set, no --local_rank; DeepSpeed's launcher's --local_rank=N is a case above),
    --num_gpus 2 is one line naming it, never a nested launch of two more processes per process."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(alias_module.subprocess, "call", lambda *a, **k: pytest.fail(f"a nested launch: {a}"))
    with pytest.raises(SystemExit) as exit_info:
        alias_main(["--num_gpus", "2", "main.py"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert "--num_gpus starts processes: give it to the first command, not inside torchrun" in lines[0], lines

