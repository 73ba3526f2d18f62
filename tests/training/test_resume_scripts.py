"""What the README and docs/checkpoints.md say of running `make pretrain`'s script again, run exactly as written:
  - the same command after an interruption (here `--exit-interval 10` of 20) continues bit for bit: the losses of
    iterations 15 and 20 equal the uninterrupted run's (conftest's ds_pretrained, the same script and recipe);
  - the same command with a larger TRAIN_ITERS trains further: the schedule is re-laid over the new --train-iters
    (iteration n gets the lr a run started with that TRAIN_ITERS has at n, written out here with math.cos), named
    in a start-up line, and the log is appended to.
"""
import json
import math
import shutil

from tests.helpers import run_script, SHORT_PRETRAIN

MAX_LR, MIN_LR = 2e-3, 1e-5   # scripts/_common.sh's CPU recipe: --lr $LR (2e-3) --min-lr 1e-5, cosine, --warmup 0.01


def cosine_lr(n, train_iters):
    """The recipe's schedule by hand: warmup int(0.01 x train_iters) (0 below 100 iterations), then cosine."""
    warmup = int(0.01 * train_iters)
    if warmup and n <= warmup:
        return MAX_LR * n / warmup
    progress = (n - warmup) / (train_iters - warmup)
    return MIN_LR + (MAX_LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def training_records(log_jsonl):
    records = [json.loads(line) for line in log_jsonl.read_text().splitlines()]
    return {r["iteration"]: r for r in records if r["type"] == "train"}


def test_running_the_script_again_with_a_larger_train_iters_trains_further(tmp_path, ds_pretrained):
    pretrained, _ = ds_pretrained
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(pretrained, checkpoint)
    stdout = run_script("ds_pretrain_gpt.sh", dict(SHORT_PRETRAIN, TRAIN_ITERS="30", CHECKPOINT_PATH=str(checkpoint)))
    assert (f" > resuming at iteration 20: lr {cosine_lr(20, 30):.6E} (cosine over 30 iterations, warmup 0; "
            "re-laid by --train-iters 30 (the checkpoint's ran over 20): each iteration gets the lr a run started "
            "with --train-iters 30 has there)") in stdout.splitlines(), stdout[:3000]
    records = training_records(checkpoint / "log.jsonl")
    assert sorted(records) == [5, 10, 15, 20, 25, 30]                      # appended to the first run's log
    for iteration in (25, 30):   # a record's lr is the one its scheduler step left: the schedule at `iteration`
        assert math.isclose(records[iteration]["learning_rate"], cosine_lr(iteration, 30), rel_tol=1e-12), iteration
    assert records[25]["learning_rate"] > cosine_lr(20, 20)   # the new steps train (the old schedule had ended)
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "30"


def test_an_interrupted_run_resumed_with_the_same_command_equals_the_uninterrupted_run(tmp_path, ds_pretrained):
    pretrained, _ = ds_pretrained
    env = dict(SHORT_PRETRAIN, CHECKPOINT_PATH=str(tmp_path / "ckpt"), EXTRA_ARGS="--exit-interval 10")
    run_script("ds_pretrain_gpt.sh", env)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    stdout = run_script("ds_pretrain_gpt.sh", env)
    assert (" > resuming at iteration 10: lr "
            f"{cosine_lr(10, 20):.6E} (cosine over 20 iterations, warmup 0; the checkpoint's schedule)") in stdout
    resumed, straight = training_records(tmp_path / "ckpt" / "log.jsonl"), training_records(pretrained / "log.jsonl")
    assert sorted(resumed) == sorted(straight) == [5, 10, 15, 20]
    for iteration in (5, 10, 15, 20):
        assert resumed[iteration]["losses"] == straight[iteration]["losses"], iteration
        assert resumed[iteration]["learning_rate"] == straight[iteration]["learning_rate"], iteration
