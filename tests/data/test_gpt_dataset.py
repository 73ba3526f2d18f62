"""GPTDataset: indices equal a plain-Python transliteration of Megatron-LM v2.6 (gpt_dataset.py + helpers.cpp),
samples are consecutive tokens of the shuffled stream, and the index cache is reused, keyed and race-free."""
import glob
import multiprocessing
import os

import numpy as np
import pytest

from megatron.data.gpt_dataset import (build_blending_indices, build_index_arrays, build_train_valid_test_datasets,
                                       get_train_valid_test_split_)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.spawn import run_distributed


# ------------------------------------------------------------------ reference: Megatron-LM v2.6, loops kept as loops
def reference_indices(sizes, documents, num_samples, seq_length, seed):
    tokens_per_epoch = int(sum(sizes[d] for d in documents))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    rng = np.random.RandomState(seed=seed)
    separate = False
    if num_epochs > 1:
        from_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - from_minus_one) < int(0.80 * per_epoch)

    def doc_idx_for(epochs):
        doc_idx = np.mgrid[0:epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx

    doc_idx = (np.concatenate((doc_idx_for(num_epochs - 1), doc_idx_for(1))) if separate
               else doc_idx_for(num_epochs))
    # helpers.cpp build_sample_idx
    n = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = [[0, 0]]
    doc_idx_index, doc_offset = 0, 0
    for _ in range(n):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx.append([doc_idx_index, doc_offset])
    first = from_minus_one if separate else n
    shuffle_first = np.arange(first, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    shuffle_last = np.arange(first, n, dtype=np.uint32)
    rng.shuffle(shuffle_last)
    shuffle_idx = np.concatenate((shuffle_first, shuffle_last)) if first != n else shuffle_first
    return doc_idx, np.array(sample_idx), shuffle_idx, num_epochs, separate


CASES = [  # (number of docs, max doc length, zero-length docs?, num_samples, seq_length)
    (50, 40, False, 10, 16),       # one epoch
    (50, 40, False, 300, 16),      # several epochs, last one small -> separate last epoch
    (30, 40, False, 118, 8),       # several epochs, last one nearly full -> not separate
    (20, 5, True, 40, 32),         # samples spanning many short docs, zero-length docs in between
    (7, 300, False, 50, 7),        # samples inside long docs
]


@pytest.mark.parametrize("case", CASES)
def test_indices_equal_plain_python_reference(case):
    num_docs, max_len, zeros, num_samples, seq_length = case
    rng = np.random.default_rng(num_docs)
    sizes = rng.integers(0 if zeros else 1, max_len + 1, size=num_docs + 5).astype(np.int32)
    documents = np.arange(3, num_docs + 3, dtype=np.int32)  # a split that starts after the first sequences
    doc_idx, sample_idx, shuffle_idx = build_index_arrays(sizes, documents, num_samples, seq_length, seed=7)
    ref_doc, ref_sample, ref_shuffle, epochs, separate = reference_indices(sizes, documents, num_samples,
                                                                           seq_length, 7)
    assert doc_idx.dtype == np.int32 and shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(doc_idx, ref_doc)
    np.testing.assert_array_equal(sample_idx, ref_sample)
    np.testing.assert_array_equal(shuffle_idx, ref_shuffle)
    assert len(shuffle_idx) >= num_samples


def _independent_index_arrays(sizes, documents, num_samples, seq_length, seed):
    """Megatron's recipe in closed form (FORMAT.md section 2), written apart from the reference above:
    (num_epochs, separate, doc_idx, sample_idx, shuffle_idx)."""
    sizes, documents = np.asarray(sizes, dtype=np.int64), np.asarray(documents, dtype=np.int32)
    T, L = int(sizes[documents].sum()), seq_length
    epochs = max(1, -(-(num_samples * L + 1) // T))               # smallest e with e * T >= n * L + 1
    n_first = ((epochs - 1) * T - 1) // L
    separate = epochs > 1 and num_samples - n_first < int(0.80 * ((T - 1) // L))
    rng = np.random.RandomState(seed)
    if separate:
        head, tail = np.tile(documents, epochs - 1), documents.copy()
        rng.shuffle(head)
        rng.shuffle(tail)
        doc_idx = np.concatenate((head, tail))
    else:
        doc_idx = np.tile(documents, epochs)
        rng.shuffle(doc_idx)
    n = (epochs * T - 1) // L
    ends = np.cumsum(sizes[doc_idx])                                # stream position after each doc_idx entry
    sample_idx = []
    for k in range(n + 1):                                          # sample k starts at stream token k * L
        position = int(np.argmax(ends > k * L))
        sample_idx.append([position, k * L - int(ends[position] - sizes[doc_idx[position]])])
    sample_idx[0] = [0, 0]
    if separate:
        first, last = np.arange(n_first, dtype=np.uint32), np.arange(n_first, n, dtype=np.uint32)
        rng.shuffle(first)
        rng.shuffle(last)
        shuffle_idx = np.concatenate((first, last))
    else:
        shuffle_idx = np.arange(n, dtype=np.uint32)
        rng.shuffle(shuffle_idx)
    return epochs, separate, doc_idx, np.array(sample_idx), shuffle_idx


def test_both_last_epoch_branches_against_independent_computation():
    """The project's build_index_arrays on cases that take each branch of the separate-last-epoch decision:
    equal to the closed-form computation, and showing the branch's signature (the last epoch shuffled on its
    own: its doc_idx entries are each document once, its samples shuffled apart from the others)."""
    branches, boundary = set(), []
    # Two epochs whose last one supplies one sample less than the 80% threshold, and exactly the threshold:
    # 40 documents, T = 40 * 10 = 400 tokens, L = 16: per epoch (400 - 1) // 16 = 24 samples, threshold
    # int(0.8 * 24) = 19; the first epoch gives (400 - 1) // 16 = 24, so 24 + 18 = 42 samples -> separate,
    # 24 + 19 = 43 -> not separate (both need 2 epochs: 43 * 16 + 1 = 689 <= 800).
    boundary_cases = [(40, None, False, 42, 16), (40, None, False, 43, 16)]
    for num_docs, max_len, zeros, num_samples, seq_length in CASES + boundary_cases:
        if max_len is None:     # documents of 10 tokens: the arithmetic above
            sizes = np.full(num_docs + 5, 10, dtype=np.int32)
        else:
            sizes = np.random.default_rng(num_docs).integers(0 if zeros else 1, max_len + 1,
                                                             size=num_docs + 5).astype(np.int32)
        documents = np.arange(3, num_docs + 3, dtype=np.int32)
        doc_idx, sample_idx, shuffle_idx = build_index_arrays(sizes, documents, num_samples, seq_length, seed=7)
        epochs, separate, want_doc, want_sample, want_shuffle = _independent_index_arrays(
            sizes, documents, num_samples, seq_length, 7)
        branches.add((epochs > 1, separate))
        if max_len is None:
            boundary.append((epochs, separate))
        assert len(doc_idx) == epochs * num_docs
        np.testing.assert_array_equal(doc_idx, want_doc)
        np.testing.assert_array_equal(sample_idx, want_sample)
        np.testing.assert_array_equal(shuffle_idx, want_shuffle)
        if separate:
            T = int(sizes[documents].sum())
            n_first = ((epochs - 1) * T - 1) // seq_length
            assert sorted(doc_idx[-num_docs:]) == list(documents)
            assert sorted(shuffle_idx[:n_first]) == list(range(n_first))
        elif epochs > 1:     # one shuffle over all epochs: the last D entries are not one copy of each document
            assert sorted(doc_idx[-num_docs:]) != list(documents)
    assert branches == {(False, False), (True, True), (True, False)}
    assert boundary == [(2, True), (2, False)]


def _equal_length_dataset(directory, num_docs, doc_length):
    """num_docs documents of doc_length tokens each; token = 100 * document + position."""
    prefix = os.path.join(directory, "equal")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(num_docs):
        builder.add_item(100 * d + np.arange(doc_length, dtype=np.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


# 5 documents of 4 tokens: T = 20 tokens per epoch, L = 5. num_samples * L is an exact number of epochs, but each
# sample needs L + 1 tokens (the last one is the next sample's first), so one more epoch is needed:
#   4 samples: 4 * 5 = 20 = 1 epoch -> 2 epochs (40 tokens), (40 - 1) // 5 = 7 samples
#   8 samples: 8 * 5 = 40 = 2 epochs -> 3 epochs (60 tokens), (60 - 1) // 5 = 11 samples
# With equal document lengths the sample starts do not depend on the shuffle: sample k starts at stream token 5k,
# i.e. doc_idx position 5k // 4, offset 5k % 4.
EXACT_EPOCH_CASES = [
    (4, 2, 7, [[0, 0], [1, 1], [2, 2], [3, 3], [5, 0], [6, 1], [7, 2], [8, 3]]),
    (8, 3, 11, [[0, 0], [1, 1], [2, 2], [3, 3], [5, 0], [6, 1], [7, 2], [8, 3], [10, 0], [11, 1], [12, 2],
                [13, 3]]),
]


@pytest.mark.parametrize("num_samples,epochs,total,sample_starts", EXACT_EPOCH_CASES)
def test_samples_times_seq_length_equal_to_whole_epochs(tmp_path, num_samples, epochs, total, sample_starts):
    num_docs, doc_length, seq_length, seed = 5, 4, 5, 11
    sizes, documents = np.full(num_docs, doc_length, dtype=np.int32), np.arange(num_docs, dtype=np.int32)
    assert num_samples * seq_length % (num_docs * doc_length) == 0          # the exact case
    doc_idx, sample_idx, shuffle_idx = build_index_arrays(sizes, documents, num_samples, seq_length, seed)
    assert len(doc_idx) == epochs * num_docs
    assert sorted(doc_idx.tolist()) == sorted(list(range(num_docs)) * epochs)
    assert sample_idx.tolist() == sample_starts
    assert len(shuffle_idx) == total >= num_samples and sorted(shuffle_idx.tolist()) == list(range(total))

    prefix = _equal_length_dataset(str(tmp_path), num_docs, doc_length)
    train = build_train_valid_test_datasets([prefix], "100,0,0", [num_samples, 0, 0], seq_length, seed)[0]
    assert len(train) == total >= num_samples
    stream = np.concatenate([100 * int(d) + np.arange(doc_length) for d in train.doc_idx])
    seen = set()
    for i in range(len(train)):
        k = int(train.shuffle_idx[i])
        np.testing.assert_array_equal(train[i]["text"], stream[k * seq_length: k * seq_length + seq_length + 1])
        seen.add(k)
    assert seen == set(range(total))


def test_split_matches_megatron_v26():
    assert get_train_valid_test_split_("949,50,1", 10) == [0, 10, 10, 10]
    assert get_train_valid_test_split_("949,50,1", 50) == [0, 48, 50, 50]
    assert get_train_valid_test_split_("949/50/1", 6191) == [0, 5875, 6185, 6191]
    assert get_train_valid_test_split_("8,2", 100) == [0, 80, 100, 100]
    with pytest.raises(ValueError, match="--split 'a,b'"):
        get_train_valid_test_split_("a,b", 10)


# ------------------------------------------------------------------ on a real indexed dataset
def make_dataset(directory, num_docs=60, seed=0, name="toy"):
    """Documents of random length whose tokens encode (document, position) so samples can be checked."""
    rng = np.random.default_rng(seed)
    prefix = os.path.join(directory, name)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    docs = []
    for d in range(num_docs):
        doc = d * 1000 + np.arange(rng.integers(1, 60), dtype=np.int32)
        builder.add_item(doc)
        builder.end_document()
        docs.append(doc)
    builder.finalize(prefix + ".idx")
    return prefix, docs


def test_samples_are_consecutive_stream_tokens_and_cover_the_epoch(tmp_path):
    prefix, docs = make_dataset(str(tmp_path))
    seq_length = 16
    train, valid, test = build_train_valid_test_datasets([prefix], "80,10,10", [100, 10, 0], seq_length, 1234)
    assert test is None
    for ds, first_doc in ((train, 0), (valid, 48)):
        stream = np.concatenate([docs[d] for d in ds.doc_idx])
        assert set(np.asarray(ds.doc_idx).tolist()) <= set(range(first_doc, first_doc + len(docs)))
        samples = {}
        for i in range(len(ds)):
            text = ds[i]["text"]
            k = int(ds.shuffle_idx[i])
            assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
            np.testing.assert_array_equal(text, stream[k * seq_length: k * seq_length + seq_length + 1])
            samples[k] = text
        assert sorted(samples) == list(range(len(ds)))
        # every token of the split's first epoch appears in some sample
        epoch_tokens = int(sum(len(docs[d]) for d in set(np.asarray(ds.doc_idx).tolist())))
        covered = np.zeros(len(stream), dtype=bool)
        for k in samples:
            covered[k * seq_length: k * seq_length + seq_length + 1] = True
        first_epoch = np.concatenate([docs[d] for d in ds.doc_idx[: len(set(np.asarray(ds.doc_idx).tolist()))]])
        assert covered[:epoch_tokens].all() and len(first_epoch) == epoch_tokens
    assert len(train) >= 100 and len(valid) >= 10


def _cache_files(directory):
    return sorted(glob.glob(os.path.join(directory, "*_indexmap_*")))


def test_cache_is_reused_and_keyed_by_every_input(tmp_path):
    prefix, _ = make_dataset(str(tmp_path))
    base = dict(data_prefix=[prefix], splits_string="80,10,10", train_valid_test_num_samples=[50, 0, 0],
                seq_length=16, seed=1234)
    first = build_train_valid_test_datasets(**base)[0]
    files = _cache_files(str(tmp_path))
    assert len(files) == 4 and isinstance(first.shuffle_idx, np.memmap)
    mtimes = [os.path.getmtime(f) for f in files]
    second = build_train_valid_test_datasets(**base)[0]
    assert [os.path.getmtime(f) for f in files] == mtimes
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    names = {tuple(files)}
    for change in (dict(seed=1), dict(seq_length=8), dict(train_valid_test_num_samples=[60, 0, 0]),
                   dict(splits_string="70,20,10")):
        before = set(_cache_files(str(tmp_path)))
        build_train_valid_test_datasets(**dict(base, **change))
        new = set(_cache_files(str(tmp_path))) - before
        assert len(new) == 4, change
        names.add(tuple(sorted(new)))
    # same name, different data: rewriting the dataset changes the cache key
    make_dataset(str(tmp_path), seed=1)
    before = set(_cache_files(str(tmp_path)))
    build_train_valid_test_datasets(**base)
    assert len(set(_cache_files(str(tmp_path))) - before) == 4
    # --data-cache-path puts the files elsewhere
    cache_dir = str(tmp_path / "cache")
    build_train_valid_test_datasets(**base, data_cache_path=cache_dir)
    assert len(_cache_files(cache_dir)) == 4


def test_partial_cache_without_description_is_rebuilt(tmp_path):
    prefix, _ = make_dataset(str(tmp_path))
    args = ([prefix], "100,0,0", [50, 0, 0], 16, 5)
    expected = build_train_valid_test_datasets(*args)[0]
    reference = np.array(expected.sample_idx)
    for path in _cache_files(str(tmp_path)):
        if path.endswith("_sample_idx.npy"):
            with open(path, "r+b") as f:
                f.truncate(100)  # a crash mid-write of a non-atomic writer
        if path.endswith("_description.json"):
            os.remove(path)
    again = build_train_valid_test_datasets(*args)[0]
    np.testing.assert_array_equal(again.sample_idx, reference)


def _build_in_process(prefix, barrier):
    barrier.wait()
    ds = build_train_valid_test_datasets([prefix], "100,0,0", [2000, 0, 0], 8, 99)[0]
    return [np.array(ds.doc_idx).tobytes(), np.array(ds.sample_idx).tobytes(), np.array(ds.shuffle_idx).tobytes()]


def _race_worker(prefix, barrier, queue):
    queue.put(_build_in_process(prefix, barrier))


def _expected(prefix):
    sizes = np.array(MMapIndexedDataset(prefix).sizes)
    arrays = build_index_arrays(sizes, np.arange(len(sizes), dtype=np.int32), 2000, 8, 99)
    return [a.tobytes() for a in arrays]


def test_racing_processes_read_complete_files(tmp_path):
    prefix, _ = make_dataset(str(tmp_path), num_docs=3000)
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(prefix, barrier, queue)) for _ in range(3)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert all(proc.exitcode == 0 for proc in procs)
    expected = _expected(prefix)
    assert all(result == expected for result in results)
    assert len(_cache_files(str(tmp_path))) == 4


class _NoBarrier:
    def wait(self):
        pass


def _distributed_build(prefix):
    return _build_in_process(prefix, _NoBarrier())


def test_distributed_rank0_builds_others_wait(tmp_path):
    prefix, _ = make_dataset(str(tmp_path), num_docs=3000)
    results = run_distributed(_distributed_build, world_size=2, args=(prefix,))
    assert results[0] == results[1] == _expected(prefix)


def test_blending(tmp_path):
    assert build_blending_indices([0.5, 0.5], 6)[0].tolist() == [0, 1, 0, 1, 0, 1]
    index, sample = build_blending_indices([0.7, 0.2, 0.1], 1000)
    assert np.bincount(index).tolist() == [700, 200, 100]
    for d in range(3):
        assert sample[index == d].tolist() == list(range((index == d).sum()))
    a, docs_a = make_dataset(str(tmp_path), seed=0, name="a")
    b, docs_b = make_dataset(str(tmp_path), seed=1, name="b")
    train = build_train_valid_test_datasets(["0.75", a, "0.25", b], "100,0,0", [200, 0, 0], 16, 3)[0]
    assert len(train) == sum(len(d) for d in train.datasets)
    counts = np.bincount(train.dataset_index)
    assert abs(counts[0] / len(train) - 0.75) < 0.01
    np.testing.assert_array_equal(train[5]["text"],
                                  train.datasets[train.dataset_index[5]][int(train.dataset_sample_index[5])]["text"])


def test_errors(tmp_path):
    prefix, _ = make_dataset(str(tmp_path), num_docs=3)
    with pytest.raises(ValueError, match="too few"):
        build_index_arrays(np.array([1, 0]), np.arange(2), 10, 4, 0)
    with pytest.raises(ValueError, match="weight prefix"):
        build_train_valid_test_datasets(["0.5", prefix, "0.5"], "100,0,0", [10, 0, 0], 4, 0)
    with pytest.raises(Exception, match="nothing.idx: file not found"):
        build_train_valid_test_datasets([str(tmp_path / "nothing")], "100,0,0", [10, 0, 0], 4, 0)


def _build_with_rank0_failing(prefix):
    """Rank 0's index build raises: every rank must raise instead of waiting for files that never appear."""
    import torch.distributed as dist
    from megatron.data import gpt_dataset
    if dist.get_rank() == 0:
        def failing(*args, **kwargs):
            raise OSError("Read-only file system")
        gpt_dataset._build_and_save = failing
    try:
        _build_in_process(prefix, _NoBarrier())
        return "built"
    except (OSError, RuntimeError) as error:
        return str(error)


def test_rank0_build_failure_reaches_every_rank(tmp_path):
    prefix, _ = make_dataset(str(tmp_path), num_docs=300)
    messages = run_distributed(_build_with_rank0_failing, world_size=2, args=(prefix,))
    assert messages[0] == "Read-only file system"
    assert "failed on rank 0" in messages[1]
