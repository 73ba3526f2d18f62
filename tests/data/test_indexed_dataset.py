"""Megatron mmap indexed dataset: exact bytes from FORMAT.md, round trips, merging, and errors naming the file."""
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder,
                                           best_fitting_dtype, make_builder)

# FORMAT.md section 1: docs [[464, 2068], [7586, 50256]] and [[15496, 995, 50256]] as uint16
EXPECTED_IDX = bytes.fromhex(
    "4d4d4944494458 0000"
    "0100000000000000"
    "08"
    "0300000000000000"
    "0300000000000000"
    "020000000200000003000000"
    "000000000000000004000000000000000800000000000000"
    "000000000000000002000000000000000300000000000000".replace(" ", ""))
EXPECTED_BIN = bytes.fromhex("d0011408a21d50c4883ce30350c4")


def _write_format_example(prefix, use_add_document=False):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    if use_add_document:
        builder.add_document([464, 2068, 7586, 50256], lengths=[2, 2])
        builder.add_documents(np.array([15496, 995, 50256]), [3], [1])
    else:
        builder.add_item([464, 2068])
        builder.add_item(np.array([7586, 50256]))
        builder.end_document()
        builder.add_item([15496, 995, 50256])
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("use_add_document", [False, True])
def test_bytes_match_format_md(tmp_path, use_add_document):
    prefix = str(tmp_path / "u16")
    _write_format_example(prefix, use_add_document)
    assert len(EXPECTED_IDX) == 94
    assert open(prefix + ".idx", "rb").read() == EXPECTED_IDX
    assert open(prefix + ".bin", "rb").read() == EXPECTED_BIN


def test_reader(tmp_path):
    prefix = str(tmp_path / "u16")
    _write_format_example(prefix)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.uint16
    assert ds.sizes.tolist() == [2, 2, 3] and ds.doc_idx.tolist() == [0, 2, 3]
    assert ds[1].tolist() == [7586, 50256]
    assert [a.tolist() for a in ds[0:3:2]] == [[464, 2068], [15496, 995, 50256]]
    assert ds.get(2, offset=1).tolist() == [995, 50256]
    assert ds.get(2, offset=1, length=1).tolist() == [995]
    assert ds.get(2, offset=3).tolist() == []
    with pytest.raises(IndexError):
        ds.get(2, offset=2, length=2)


def test_dtype_choice_and_int32_round_trip(tmp_path):
    assert best_fitting_dtype(50257) == np.uint16 and best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    prefix = str(tmp_path / "i32")
    builder = make_builder(prefix + ".bin", vocab_size=100_000)
    docs = [[70000, 1, 2], [99999], []]
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    idx = open(prefix + ".idx", "rb").read()
    assert idx[17] == 4 and len(idx) == 34 + 12 * 3 + 8 * 4
    ds = MMapIndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(3)] == docs
    with pytest.raises(ValueError, match="does not fit uint16"):
        MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16).add_item([70000])


def test_merge_file_appends_documents(tmp_path):
    rng = np.random.default_rng(0)
    parts = []
    for name in ("a", "b"):
        prefix = str(tmp_path / name)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        docs = [[rng.integers(0, 1000, size=rng.integers(1, 9)) for _ in range(rng.integers(1, 4))]
                for _ in range(5)]
        for doc in docs:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        parts.append((prefix, docs))
    merged = str(tmp_path / "merged")
    builder = MMapIndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    builder.merge_file_(parts[0][0])
    builder.merge_file_(parts[1][0])
    builder.finalize(merged + ".idx")
    ds = MMapIndexedDataset(merged)
    all_docs = parts[0][1] + parts[1][1]
    assert len(ds.doc_idx) == len(all_docs) + 1
    for k, doc in enumerate(all_docs):
        got = [ds[i].tolist() for i in range(ds.doc_idx[k], ds.doc_idx[k + 1])]
        assert got == [seq.tolist() for seq in doc]


def _corrupt(tmp_path, edit):
    prefix = str(tmp_path / "u16")
    _write_format_example(prefix)
    edit(prefix)
    return prefix


@pytest.mark.parametrize("edit, file_suffix, message", [
    (lambda p: open(p + ".bin", "r+b").truncate(10), ".bin", "truncated: 10 bytes"),
    (lambda p: open(p + ".idx", "r+b").write(b"XXIDIDX\x00\x00"), ".idx", "bad magic"),
    (lambda p: (lambda f: (f.seek(9), f.write(struct.pack("<Q", 2))))(open(p + ".idx", "r+b")), ".idx",
     "unsupported version 2"),
    (lambda p: (lambda f: (f.seek(17), f.write(b"\x09")))(open(p + ".idx", "r+b")), ".idx", "unknown dtype code 9"),
    (lambda p: open(p + ".idx", "r+b").truncate(80), ".idx", "does not match its header"),
    (lambda p: open(p + ".idx", "r+b").truncate(20), ".idx", "truncated header"),
])
def test_corrupt_files_are_named(tmp_path, edit, file_suffix, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(IndexedDatasetError) as info:
        MMapIndexedDataset(prefix)
    assert prefix + file_suffix in str(info.value) and message in str(info.value)


def test_missing_files(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"nothing.idx: file not found"):
        MMapIndexedDataset(str(tmp_path / "nothing"))
    prefix = _corrupt(tmp_path, lambda p: __import__("os").remove(p + ".bin"))
    with pytest.raises(IndexedDatasetError, match=r"u16.bin: file not found"):
        MMapIndexedDataset(prefix)
