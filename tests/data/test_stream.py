"""Raw shards streamed as training data (megatron/data/stream): with shuffling off, the samples are the token stream
tools/preprocess_data.py writes for the same documents, cut into GPTDataset's seq_length + 1 windows; with it on,
the order is a function of the seed and the global sample index (shard order per epoch, the shuffle buffer), and
every data-parallel size reads the same global batches.

Shards are tiny and made here: JSON lines, gzipped JSON lines, loose JSON and Parquet in several row groups, with a
blank line, an empty document and a whitespace-only one (the cases where the EOD placement and the row count can
go wrong)."""
import gzip
import json
import os

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.gpt_dataset import build_blending_indices
from megatron.data.stream import BlendedStreamLoader, StreamConfig, StreamDataError, StreamLoader
from megatron.data.stream.documents import shard_order
from megatron.tokenizer import GPT2BPETokenizer
from tests.helpers import HAND_DOCS, write_jsonl

import preprocess_data  # noqa: E402  (tools/, on sys.path through tests.helpers)

SEQ = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def documents(count, seed=0):
    """`count` documents of a few dozen tokens, different lengths (some shorter than a window, some longer)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + f" doc{seed}-{i}." for i in range(count)]


def write_shards(directory, texts_per_shard):
    """One shard per entry, cycling through the four formats (file names sort in the given order)."""
    paths = []
    for i, texts in enumerate(texts_per_shard):
        kind = ("jsonl", "jsonl.gz", "parquet", "json")[i % 4]
        path = os.path.join(directory, f"shard_{i:02d}.{kind}")
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=3)
        else:
            lines = "".join(json.dumps({"text": t, "id": j}) + "\n" + ("\n" if j == 1 else "")  # a blank line
                            for j, t in enumerate(texts)).encode()
            with (gzip.open if kind.endswith("gz") else open)(path, "wb") as f:
                f.write(lines)
        paths.append(path)
    return paths


def loader(paths, vocab, *, append_eod=True, shuffle_shards=False, shuffle_buffer=0, micro=1, rank=0, dp=1,
           workers=0, seed=5):
    config = StreamConfig(tuple(paths), "text", vocab["vocab"], vocab["merges"], append_eod, seed, shuffle_shards)
    return StreamLoader(config, SEQ, shuffle_buffer, micro, rank, dp, num_workers=workers)


def windows(tokens, count):
    """GPTDataset's cut of a token stream: window k = tokens[k*SEQ : k*SEQ + SEQ + 1]."""
    return [tokens[k * SEQ:k * SEQ + SEQ + 1] for k in range(count)]


@pytest.fixture(scope="module")
def vocab(webtext_data):
    return {"vocab": os.path.join(webtext_data, "vocab.json"), "merges": os.path.join(webtext_data, "merges.txt")}


def preprocessed_tokens(texts, vocab, tmp_path, append_eod):
    """The token stream tools/preprocess_data.py writes for `texts` (one loose-JSON file, in order)."""
    corpus = write_jsonl(str(tmp_path / "all.json"), texts)
    args = preprocess_data.get_args(["--input", corpus, "--output-prefix", str(tmp_path / "pre"), "--vocab-file",
                                     vocab["vocab"], "--merge-file", vocab["merges"], "--tokenizer-type",
                                     "GPT2BPETokenizer"] + (["--append-eod"] if append_eod else []))
    prefix = preprocess_data.preprocess(args)["outputs"]["text"]
    dataset = MMapIndexedDataset(prefix)
    return np.concatenate([dataset.get(i) for i in range(len(dataset))]).astype(np.int64)


@pytest.mark.parametrize("append_eod,workers", [(True, 0), (True, 2), (False, 0)])
def test_stream_equals_preprocessed_windows(vocab, tmp_path, append_eod, workers):
    """Shuffling off: sample k == window k of preprocess_data's tokens for the documents of all shards in sorted
    order (four formats, Parquet in row groups of 3), with and without --append-eod, tokenized here or in 2 worker
    processes. Packing carries the last token of a window into the next, and over shard boundaries."""
    per_shard = [documents(4, 1) + HAND_DOCS[:3], documents(5, 2), documents(7, 3) + [""], documents(3, 4)]
    paths = write_shards(str(tmp_path), per_shard)
    expected = preprocessed_tokens([t for texts in per_shard for t in texts], vocab, tmp_path, append_eod)
    count = (len(expected) - 1) // SEQ
    stream = loader(paths, vocab, append_eod=append_eod, micro=count, workers=workers)
    got = next(stream)["text"].numpy()
    assert count > 20 and got.shape == (count, SEQ + 1)
    np.testing.assert_array_equal(got, np.stack(windows(expected, count)))
    # the next epoch begins right after the first's last token: window `count` straddles the wrap
    tail = expected[count * SEQ:]
    np.testing.assert_array_equal(next(loader(paths, vocab, append_eod=append_eod, micro=count + 1))["text"][-1],
                                  np.concatenate([tail, expected[:SEQ + 1 - len(tail)]]))


def tokenized(texts, vocab):
    tokenizer = GPT2BPETokenizer(vocab["vocab"], vocab["merges"])
    return [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts if tokenizer.tokenize(t)]


def test_shard_order_is_seeded_per_epoch(vocab, tmp_path):
    """With a shuffled shard order, epoch e reads the shards in default_rng([seed, e]).permutation's order: two
    epochs' samples equal the windows of the documents tokenized here in those two orders."""
    per_shard = [documents(2, s) for s in range(6)]
    paths = write_shards(str(tmp_path), per_shard)
    orders = [shard_order(6, 5, epoch, True) for epoch in (0, 1)]
    assert orders[0] != orders[1] and orders[0] != list(range(6))
    stream_tokens = [tok for order in orders for shard in order for doc in tokenized(per_shard[shard], vocab)
                     for tok in doc]
    count = (len(stream_tokens) - 1) // SEQ
    got = next(loader(paths, vocab, shuffle_shards=True, micro=count))["text"].numpy()
    np.testing.assert_array_equal(got, np.stack(windows(np.array(stream_tokens), count)))


def test_shuffle_buffer_is_a_function_of_seed_and_sample_index(vocab, tmp_path):
    """A buffer of 5: the first 5 windows fill it, then window 5 + g replaces (and emits) the buffered window at
    default_rng([seed, g]).integers(5) -- checked against that rule applied here to the unshuffled windows. A
    buffer of 4 or another seed gives another order."""
    paths = write_shards(str(tmp_path), [documents(12, 7)])
    plain = next(loader(paths, vocab, micro=40))["text"].numpy()
    buffer, expected = list(plain[:5]), []
    for g, window in enumerate(plain[5:]):
        slot = int(np.random.default_rng([5, g]).integers(5))
        expected.append(buffer[slot])
        buffer[slot] = window
    got = next(loader(paths, vocab, shuffle_buffer=5, micro=35))["text"].numpy()
    np.testing.assert_array_equal(got, np.stack(expected))
    assert not np.array_equal(next(loader(paths, vocab, shuffle_buffer=5, micro=35, seed=6))["text"], got)
    assert not np.array_equal(next(loader(paths, vocab, shuffle_buffer=4, micro=35))["text"], got)


@pytest.mark.parametrize("dp", [2, 4])
def test_global_batches_are_the_same_at_every_dp_size(vocab, tmp_path, dp):
    """Micro batch 2 at dp 2 and 4, with shard shuffling and a buffer: rank r's k-th micro batch holds global
    samples [k*2*dp + 2r, k*2*dp + 2r + 2) of the dp 1 stream (Megatron's sampler), across an epoch wrap."""
    paths = write_shards(str(tmp_path), [documents(3, s) for s in range(4)])
    options = dict(shuffle_shards=True, shuffle_buffer=3)
    reference = next(loader(paths, vocab, micro=24 * dp, **options))["text"].numpy()
    ranks = [loader(paths, vocab, micro=2, rank=r, dp=dp, **options) for r in range(dp)]
    for step in range(12):
        for r, rank in enumerate(ranks):
            first = step * 2 * dp + 2 * r
            np.testing.assert_array_equal(next(rank)["text"].numpy(), reference[first:first + 2],
                                          err_msg=f"dp {dp} rank {r} micro batch {step}")
    assert ranks[0].position.epoch >= 1


def test_print_batch_shows_what_each_rank_read(vocab, tmp_path, monkeypatch):
    """tools/print_batch.py on a stream, iteration 2 of a world of 2 with 2 micro batches of 2: rank r's micro
    batch m holds global samples 8 + 4m + 2r and the next, read from the dp 1 stream here."""
    import print_batch
    monkeypatch.setenv("WORLD_SIZE", "1")   # print_batch sets it to --world-size: restored after the test
    paths = write_shards(str(tmp_path), [documents(3, s) for s in range(2)])
    reference = next(loader(paths, vocab, shuffle_shards=True, shuffle_buffer=2, micro=16))["text"].tolist()
    records = print_batch.main(["--iteration", "2", "--world-size", "2", "--data-path", str(tmp_path / "*"),
                                "--vocab-file", vocab["vocab"], "--merge-file", vocab["merges"], "--append-eod",
                                "--stream-shuffle-buffer", "2", "--seed", "5", "--seq-length", "16", "--batch-size",
                                "2", "--global-batch-size", "8", "--train-iters", "3", "--num-layers", "1",
                                "--hidden-size", "8", "--num-attention-heads", "1"])
    assert [(r["data_parallel_rank"], r["micro_batch"], r["sample_index"]) for r in records] == [
        (0, 0, 8), (0, 0, 9), (0, 1, 12), (0, 1, 13), (1, 0, 10), (1, 0, 11), (1, 1, 14), (1, 1, 15)]
    assert [r["ids"] for r in records] == [reference[r["sample_index"]] for r in records]


def test_blend_is_megatrons_weighted_order_and_resumes(vocab, tmp_path):
    """Two sources at weights 3 : 7, dp 2, micro batch 2: global sample g is sample dataset_sample_index[g] of
    source dataset_index[g] (gpt_dataset.build_blending_indices, Megatron's BlendableDataset), so the proportions
    are Megatron's at every prefix; a dp 1 blend resumed from the record taken after 20 samples continues alike."""
    paths = []
    for name, seed in (("a", 11), ("b", 12)):
        os.makedirs(tmp_path / name)
        paths.append(write_shards(str(tmp_path / name), [documents(3, seed + s) for s in range(2)]))
    streams = [next(loader(p, vocab, shuffle_shards=True, micro=45))["text"].numpy() for p in paths]
    index, sample_index = build_blending_indices([0.3, 0.7], 60)
    expected = np.stack([streams[i][j] for i, j in zip(index, sample_index)])

    def blend(micro, rank, dp):
        return BlendedStreamLoader([loader(p, vocab, shuffle_shards=True) for p in paths], [3, 7], micro, rank, dp)
    ranks = [blend(2, 0, 2), blend(2, 1, 2)]
    got = np.concatenate([next(rank)["text"].numpy() for _ in range(15) for rank in ranks])
    np.testing.assert_array_equal(got, expected)
    first = blend(4, 0, 1)
    for _ in range(5):
        next(first)
    resumed = blend(40, 0, 1)
    resumed.load_state_dict(first.state_dict(), consumed_samples=20)
    np.testing.assert_array_equal(next(resumed)["text"].numpy(), expected[20:])


def test_split_by_document_partitions_the_documents(vocab, tmp_path):
    """--split 6,3,1 over 45 documents in 3 shards (JSON lines, gzip, Parquet): each document's tokens are in
    exactly one split's stream, the training split's or validation's or test's, each split non-empty."""
    from megatron.data.stream import split_ranges
    from megatron.data.stream.documents import document_loader
    per_shard = [documents(15, 20 + s) for s in range(3)]
    paths = write_shards(str(tmp_path), per_shard)
    expected = {(shard, i): doc for shard, texts in enumerate(per_shard) for i, doc in
                enumerate(tokenized(texts, vocab))}
    found = {}
    for split, bounds in enumerate(split_ranges("6,3,1")):
        config = StreamConfig(tuple(paths), "text", vocab["vocab"], vocab["merges"], True, 5, False, bounds)
        for doc in document_loader(config, (0, 0, 0)):
            if doc.epoch:
                break
            if len(doc.tokens):
                index = doc.row - (doc.row >= 2 and doc.shard != 2)   # the JSON lines' blank line after row 1
                assert (doc.shard, index) not in found, "a document in two splits"
                found[(doc.shard, index)] = (split, doc.tokens.tolist())
    assert {key: tokens for key, (_, tokens) in found.items()} == expected
    assert {split for split, _ in found.values()} == {0, 1, 2}


def test_resume_starts_at_the_record_not_at_the_start(vocab, tmp_path):
    """A stream resumed from its record opens nothing before the record's shard and row: with the first shard
    replaced by garbage after the record was taken, the resumed stream still continues exactly, while a resume
    without the record (re-reading the consumed samples) runs into the garbage."""
    from megatron.data.stream import StreamSource
    paths = write_shards(str(tmp_path), [documents(4, 30), documents(6, 31)])
    config = StreamConfig(tuple(paths), "text", vocab["vocab"], vocab["merges"], True, 5, False)
    first = StreamSource(config, SEQ, 100).loader(1, 0, 1)
    while first.position.shard == 0:
        next(first)
    record, continuation = first.state_dict(), [next(first)["text"] for _ in range(3)]
    with open(paths[0], "w") as f:
        f.write("{garbage\n" * 4)
    resumed = StreamSource(config, SEQ, 100).loader(1, 0, 1, record=record, consumed_samples=record["samples"])
    assert all(np.array_equal(next(resumed)["text"], batch) for batch in continuation)
    with pytest.raises(StreamDataError, match="malformed JSON"):
        StreamSource(config, SEQ, 100).loader(1, 0, 1, consumed_samples=record["samples"])
