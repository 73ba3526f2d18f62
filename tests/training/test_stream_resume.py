"""A raw-shard stream resumes exactly (issue 69 item 3): per-iteration losses of 6 straight steps equal 3 + resume + 3
and 2 + resume + 2 + resume + 2, bitwise (fp32, dp 2), and the stream's record in the last checkpoint equals the
straight run's; a dp 2 -> dp 4 -> dp 2 chain reads exactly the straight run's global samples (token ids).

The corpus is ~15 samples, so 8-sample global batches wrap an epoch about every other iteration (the shard order
changes per epoch) and every saved position is inside a document (a non-trivial carry); a shuffle buffer of 3 is
saved too. The second-resume bug class (a record that is not refreshed after a load, so a run resumed twice starts
over at the first resume's position) fails each check here."""
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.data.test_stream import documents, write_shards
from tests.helpers import assert_bitwise, set_tracker, TINY_SHAPE, write_config
from tests.training.test_restarts import _final_tensors, _torchrun

ITERS = 6


def _train_recording(args_list):
    """pretrain_gpt.main, with every micro batch the stream hands this rank recorded (history["batches"])."""
    import pretrain_gpt
    from megatron.data.stream.loader import StreamLoader
    seen, original = [], StreamLoader.__next__

    def recording(self):
        batch = original(self)
        seen.append(batch["text"].tolist())
        return batch
    StreamLoader.__next__ = recording
    history = pretrain_gpt.main(args_list)
    history["batches"] = seen
    return history


def _global_samples(histories):
    """The global samples the ranks read, in global order: micro step k's batches of data-parallel rank 0, 1, ...
    in turn (the ranks that read: model-parallel rank 0 of each data-parallel group)."""
    readers = [h["batches"] for h in histories if h["batches"]]
    return [sample for step in zip(*readers) for batch in step for sample in batch]


def _record(save_dir, iteration):
    path = os.path.join(save_dir, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    return torch.load(path, weights_only=True)["data_stream"]


def _assert_same_record(a, b):
    assert a.keys() == b.keys()
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, f"data-stream record differs at {key!r}: {a[key]} != {b[key]}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    """The flags of a dp 2 run on 3 tiny shards, and its 6 straight steps (a checkpoint after every step)."""
    root = tmp_path_factory.mktemp("stream")
    os.makedirs(root / "shards")
    write_shards(str(root / "shards"), [documents(2, s) for s in range(3)])
    flags = TINY_SHAPE + [
        "--data-path", str(root / "shards"), "--vocab-file", os.path.join(webtext_data, "vocab.json"),
        "--merge-file", os.path.join(webtext_data, "merges.txt"), "--append-eod", "--stream-shuffle-buffer", "3",
        "--batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--log-interval", "100",
        "--eval-iters", "0", "--lr", "1e-3", "--warmup", "0", "--seed", "7", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1"]
    straight_dir = str(root / "straight")
    straight = run_distributed(_train_recording, 2, args=(flags + ["--save", straight_dir, "--save-interval", "1"],))
    records = [_record(straight_dir, it) for it in range(1, ITERS + 1)]
    assert any(r["epoch"] >= 1 for r in records[:3]) and all(len(r["carry"]) > 1 for r in records)
    return flags, straight_dir, straight


def _resume(flags, load_dir, iteration, save_dir, world_size=2, extra=()):
    set_tracker(load_dir, iteration)
    return run_distributed(_train_recording, world_size, args=(flags + ["--load", load_dir, "--save", save_dir,
                                                                        *extra],))


def test_resume_once_is_exact(setup, tmp_path):
    """3 + resume + 3 (the resume after the epoch wrap): the same losses, samples and final stream record."""
    flags, straight_dir, straight = setup
    once = _resume(flags, straight_dir, 3, str(tmp_path / "once"))
    assert once[0]["lm loss"] == straight[0]["lm loss"][3:]
    assert _global_samples(once) == _global_samples(straight)[3 * 8:]
    _assert_same_record(_record(str(tmp_path / "once"), ITERS), _record(straight_dir, ITERS))


def test_resume_twice_is_exact(setup, tmp_path):
    """2 + resume + 2 + resume + 2 (the first before the epoch wrap, the second after it)."""
    flags, straight_dir, straight = setup
    _resume(flags, straight_dir, 2, str(tmp_path / "first"), extra=["--exit-interval", "4"])
    twice = _resume(flags, str(tmp_path / "first"), 4, str(tmp_path / "second"))
    assert twice[0]["lm loss"] == straight[0]["lm loss"][4:], "the second resume did not continue the stream"
    assert _global_samples(twice) == _global_samples(straight)[4 * 8:]
    _assert_same_record(_record(str(tmp_path / "second"), ITERS), _record(straight_dir, ITERS))


def test_resume_at_another_data_parallel_size_reads_the_same_samples(setup, tmp_path):
    """dp 2 (iterations 1-2) -> dp 4 (3-4) -> dp 2 (5-6): the global samples (token ids) of the straight dp 2 run,
    none lost or repeated; the last record equals the straight run's."""
    flags, straight_dir, straight = setup
    four = _resume(flags, straight_dir, 2, str(tmp_path / "dp4"), world_size=4, extra=["--exit-interval", "4"])
    assert _global_samples(four) == _global_samples(straight)[2 * 8:4 * 8]
    two = _resume(flags, str(tmp_path / "dp4"), 4, str(tmp_path / "dp2"))
    assert _global_samples(two) == _global_samples(straight)[4 * 8:]
    _assert_same_record(_record(str(tmp_path / "dp2"), ITERS), _record(straight_dir, ITERS))


def test_resume_at_another_model_parallel_layout_reads_the_same_samples(setup, tmp_path):
    """The dp 2 checkpoint of iteration 2 resumed at model-parallel size 2 (dp 1; the checkpoint resharded): the
    straight run's global samples of iterations 3-4, and the same record at iteration 4."""
    flags, straight_dir, straight = setup
    resumed = _resume(flags, straight_dir, 2, str(tmp_path / "mp2"),
                      extra=["--model-parallel-size", "2", "--exit-interval", "4"])
    assert not resumed[1]["batches"]       # model-parallel rank 1 gets its batches by broadcast
    assert _global_samples(resumed) == _global_samples(straight)[2 * 8:4 * 8]
    _assert_same_record(_record(str(tmp_path / "mp2"), 4), _record(straight_dir, 4))


def test_a_rank_killed_under_torchrun_restarts_bitwise_on_the_stream(setup, tmp_path):
    """torchrun (dp 2, --max-restarts 1, a checkpoint every 3 iterations): rank 1 SIGKILLed in its optimizer step
    of iteration 5, its tokenizer worker orphaned; the restarted group resumes from iteration 3 (just after an epoch
    wrap, inside a document) and its losses, final weights, optimizer and RNG states and stream record (shard, row,
    carry, shuffle buffer) equal the straight run's bitwise."""
    flags, straight_dir, straight = setup
    save = str(tmp_path / "save")
    losses, stdout = _torchrun(save, "megatron", ("step:5", 1), flags=flags + [
        "--log-interval", "1", "--save-interval", "3", "--num-workers", "1"])
    assert " at iteration 3" in stdout
    assert losses == {i: float(f"{loss:E}") for i, loss in enumerate(straight[0]["lm loss"], 1)}
    final, reference = _final_tensors(save, ITERS), _final_tensors(straight_dir, ITERS)
    assert final.keys() == reference.keys()
    assert_bitwise(reference, final)
    _assert_same_record(_record(save, ITERS), _record(straight_dir, ITERS))


def test_validation_split_is_the_same_at_every_evaluation(setup, tmp_path):
    """--split 70,20,10 by document, --eval-interval 2 --eval-iters 2 over 4 iterations: the validation at the end of
    training (no step since iteration 4's) gives iteration 4's loss bitwise: the same batches at every
    evaluation; the test split is evaluated too."""
    flags, _, _ = setup
    write_shards(str(tmp_path), [documents(10, s) for s in range(3)])   # 30 documents: each split has some
    (history,) = run_distributed(_train_recording, 1, args=(flags + [
        "--data-path", str(tmp_path), "--split", "70,20,10", "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2",
        "--global-batch-size", "2"],))
    assert len(history["valid"]) == 2 and history["valid"][0] != history["valid"][1]
    assert history["final_valid"] == history["valid"][1]
    assert "final_test" in history


def test_zero_path_resume_with_worker_processes_is_exact(setup, tmp_path):
    """The ZeRO path (--deepspeed, stage 2, dp 2) with one tokenizer worker process per rank: 2 + resume + 2 equals
    4 straight steps (losses, samples, the record in the engine's client_state)."""
    flags, _, _ = setup
    flags = flags + ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path), train_micro_batch_size_per_gpu=2,
                                                                        gradient_accumulation_steps=2),
                     "--train-iters", "4", "--num-workers", "1"]
    straight = run_distributed(_train_recording, 2, args=(flags + ["--save", str(tmp_path / "a"), "--save-interval",
                                                                   "2"],))
    resumed = _resume(flags, str(tmp_path / "a"), 2, str(tmp_path / "b"))
    assert resumed[0]["lm loss"] == straight[0]["lm loss"][2:]
    assert _global_samples(resumed) == _global_samples(straight)[2 * 8:]
    records = [torch.load(os.path.join(d, "iter_0000004", "mp_rank_00_model_states.pt"), weights_only=True)
               ["client_state"]["data_stream"] for d in (tmp_path / "a", tmp_path / "b")]
    _assert_same_record(*records)
