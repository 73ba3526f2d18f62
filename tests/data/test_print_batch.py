"""tools/print_batch.py: the ids it prints for an iteration are the rows the training loop consumed at that
iteration on each data-parallel rank (captured from get_batch in a real 2-process run with gradient
accumulation), and its text is their detokenization."""
import json
import os
import sys

import pytest
import torch

from megatron.spawn import run_distributed

from tests.helpers import REPO
from tests import warm_python


ITERATIONS, MICRO_BATCHES = 3, 2


def _flags(webtext, cache):
    return ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--data-path", os.path.join(webtext, "webtext_text_document"), "--data-cache-path", cache,
            "--vocab-file", os.path.join(webtext, "vocab.json"), "--merge-file", os.path.join(webtext, "merges.txt"),
            "--batch-size", "2", "--global-batch-size", str(2 * 2 * MICRO_BATCHES), "--train-iters",
            str(ITERATIONS), "--eval-iters", "0", "--log-interval", "100", "--seed", "11"]


def _train_capturing(args_list):
    """Every [b, s + 1] row get_batch handed to the model on this rank, in order."""
    import pretrain_gpt
    consumed, original = [], pretrain_gpt.get_batch

    def recording(data_iterator):
        tokens, labels, *rest = original(data_iterator)
        consumed.append(torch.cat([tokens, labels[:, -1:]], dim=1).tolist())
        return (tokens, labels, *rest)
    pretrain_gpt.get_batch = recording
    try:
        pretrain_gpt.main(args_list)
    finally:
        pretrain_gpt.get_batch = original
    return consumed


def _print_batch(flags, iteration):
    return warm_python.run([sys.executable, "tools/print_batch.py", "--iteration", str(iteration), "--world-size",
                            "2", *flags], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_printed_ids_are_the_consumed_batch(tmp_path, webtext_data):
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    flags = _flags(webtext_data, str(tmp_path / "cache"))
    consumed = run_distributed(_train_capturing, 2, args=(flags,))
    assert [len(rank) for rank in consumed] == [ITERATIONS * MICRO_BATCHES] * 2
    tokenizer = GPT2BPETokenizer(os.path.join(webtext_data, "vocab.json"), os.path.join(webtext_data, "merges.txt"))
    iteration = ITERATIONS   # the last one: the samples after 2 global batches
    result = _print_batch(flags, iteration)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 2 * MICRO_BATCHES * 2   # ranks x micro-batches x micro-batch size
    for rank in range(2):
        for micro in range(MICRO_BATCHES):
            mine = [r for r in records if r["data_parallel_rank"] == rank and r["micro_batch"] == micro]
            expected = consumed[rank][(iteration - 1) * MICRO_BATCHES + micro]
            assert [r["ids"] for r in mine] == expected
            assert all(r["iteration"] == iteration and len(r["ids"]) == 17 for r in mine)
            assert [r["text"] for r in mine] == [tokenizer.detokenize(ids) for ids in expected]
    assert len({r["sample_index"] for r in records}) == len(records)   # no sample twice in one iteration


def test_iteration_outside_the_run_is_refused_before_reading_data(tmp_path, webtext_data, monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import print_batch
    monkeypatch.setenv("WORLD_SIZE", "1")   # the tool sets the training run's world size in its environment
    flags = _flags(webtext_data, str(tmp_path / "cache"))
    with pytest.raises(print_batch.PrintBatchError) as error:
        print_batch.main(["--iteration", str(ITERATIONS + 1), "--world-size", "2", *flags])
    assert str(error.value) == f"--iteration {ITERATIONS + 1} is outside the run's 1..--train-iters ({ITERATIONS})"
    assert not (tmp_path / "cache").exists()
