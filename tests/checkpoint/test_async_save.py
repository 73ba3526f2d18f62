"""--async-save (DESIGN.md section 6): the training loop blocks only to snapshot the states (a forked writer
process on Linux: its copy-on-write memory image; else host copies for a writer thread); the writer writes and
fsyncs, and the next save (or the end of training) agrees, writes the manifest and publishes.

- Both paths (Megatron, ZeRO-2), dp 2: every file of an --async-save run (both checkpoints, manifest.json, the
  tracker files) equals a synchronous run's byte for byte, while the background writer is held back long enough
  that the training loop has changed the weights meanwhile (a write of the live tensors instead of the copy
  differs).
- SIGKILL inside the background write of the second checkpoint: the first stays published, verifies, and a
  fresh run resumes from it exactly (losses equal the straight run's).
- A run resumed from an async-saved checkpoint ends with a checkpoint byte-identical to the straight run's.
"""
import os
import sys
import time

import pytest

from megatron.checkpoint import manifest
from megatron.spawn import free_port, run_distributed
from megatron.checkpoint import layout as ckpt
from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE, write_config
from tests import warm_python

ARGS = MOCK_VOCAB + TINY_SHAPE + ["--batch-size", "2", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--log-interval", "100", "--eval-iters", "0", "--lr", "1e-3", "--warmup", "0",
        "--seed", "7", "--train-iters", "4", "--save-interval", "2"]        # checkpoints at iterations 2 and 4
OLD, NEW = "iter_0000002", "iter_0000004"
HOLD_SECONDS = 0.5      # the background writer waits this long: iterations 3 and 4 run meanwhile


def _flags(tmp_path, zero):
    return ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path))] if zero else []


def _train(args_list):
    import pretrain_gpt
    return pretrain_gpt.main(args_list)


def _train_with_a_slow_writer(args_list):
    """Train with the background writer held back HOLD_SECONDS (so the loop changes the weights meanwhile);
    also returns how long each save blocked the training loop and whether the loop ran during the write."""
    from megatron.checkpoint import atomic_io
    run = atomic_io._BackgroundSave._run
    ran_meanwhile = []

    def slow(self, write_files):
        start = _step_count[0]
        time.sleep(HOLD_SECONDS)
        ran_meanwhile.append(_step_count[0] > start)
        run(self, write_files)
    atomic_io._BackgroundSave._run = slow
    import megatron.training as training
    step, _step_count = training.train_step, [0]

    def counted_step(*args, **kwargs):
        _step_count[0] += 1
        return step(*args, **kwargs)
    training.train_step = counted_step
    try:
        history = _train(args_list)
    finally:
        atomic_io._BackgroundSave._run, training.train_step = run, step
    history["ran_meanwhile"] = ran_meanwhile
    return history


def _all_files(directory):
    """{relative path: bytes} of every file below `directory`."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = handle.read()
    return found


@pytest.mark.parametrize("zero", [False, True], ids=["megatron", "zero2"])
def test_async_save_files_equal_synchronous_ones_byte_for_byte(tmp_path, zero):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    flags = ARGS + _flags(tmp_path, zero)
    straight = run_distributed(_train, 2, args=(flags + ["--save", sync_dir],))
    held = run_distributed(_train_with_a_slow_writer, 2, args=(flags + ["--save", async_dir, "--async-save"],))
    # iterations 3 and 4 ran while iteration 2's files were written; iteration 4's is finished at the end at once
    assert all(h["ran_meanwhile"] == [True, False] for h in held), [h["ran_meanwhile"] for h in held]
    assert held[0]["lm loss"] == straight[0]["lm loss"]
    expected, actual = _all_files(sync_dir), _all_files(async_dir)
    names = {OLD: [f"{OLD}/{manifest.MANIFEST_FILENAME}"], NEW: [f"{NEW}/{manifest.MANIFEST_FILENAME}"]}
    assert all(name in expected for group in names.values() for name in group)
    assert sorted(actual) == sorted(expected)
    if zero:        # both data-parallel ranks' optimizer partitions
        assert sum(name.endswith("_optim_states.pt") for name in expected) == 4
    differing = [name for name in expected if expected[name] != actual[name]]
    assert not differing, f"files that differ from the synchronous save: {differing}"


KILL_RUNNER = """
import os, runpy, signal, sys, threading, torch
TRAINER = os.getpid()
real_save = torch.save
def die_in_the_background_write(obj, f, *args, **kwargs):
    in_background = os.getpid() != TRAINER or threading.current_thread() is not threading.main_thread()
    if "iter_0000004" in str(f) and in_background:  # the forked writer (or the writer thread)
        with open(f, "wb") as handle:                 # half a file, then the training process is killed
            handle.write(b"PK\\x03\\x04" + bytes(4096))
            handle.flush()
        os.kill(TRAINER, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = die_in_the_background_write
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


@pytest.mark.parametrize("zero", [False, True], ids=["megatron", "zero2"])
def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path, zero):
    save_dir = str(tmp_path / "save")
    flags = ARGS + _flags(tmp_path, zero)
    env = dict(os.environ, MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0")
    result = warm_python.run([sys.executable, "-c", KILL_RUNNER] + flags + ["--save", save_dir, "--async-save"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr[-3000:]
    assert open(os.path.join(save_dir, ckpt.TRACKER_FILENAME)).read() == "2"
    if zero:
        assert open(os.path.join(save_dir, ckpt.LATEST_FILE)).read() == OLD
    assert not os.path.exists(os.path.join(save_dir, NEW))              # only NEW.tmp, half written
    assert manifest.verify_directory(os.path.join(save_dir, OLD)) is True
    straight = run_distributed(_train, 1, args=(flags + ["--save", str(tmp_path / "straight")],))[0]
    resumed = run_distributed(_train, 1, args=(flags + ["--load", save_dir, "--save", str(tmp_path / "resumed")],))[0]
    assert resumed["iteration"] == [3, 4]
    assert resumed["lm loss"] == straight["lm loss"][2:]


@pytest.mark.parametrize("zero", [False, True], ids=["megatron", "zero2"])
def test_resume_from_an_async_saved_checkpoint_is_exact(tmp_path, zero):
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    flags = ARGS + _flags(tmp_path, zero) + ["--async-save"]
    straight = run_distributed(_train, 2, args=(flags + ["--save", straight_dir],))
    with open(os.path.join(straight_dir, ckpt.TRACKER_FILENAME), "w") as handle:
        handle.write("2")                                        # resume from the first (async-saved) checkpoint
    if zero:
        with open(os.path.join(straight_dir, ckpt.LATEST_FILE), "w") as handle:
            handle.write(OLD)
    resumed = run_distributed(_train, 2, args=(flags + ["--load", straight_dir, "--save", resumed_dir],))
    for s, r in zip(straight, resumed):
        assert r["iteration"] == [3, 4] and r["lm loss"] == s["lm loss"][2:]
    expected, actual = _all_files(os.path.join(straight_dir, NEW)), _all_files(os.path.join(resumed_dir, NEW))
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if expected[name] != actual[name]] == []
