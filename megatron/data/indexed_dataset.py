"""Megatron's memory-mapped indexed dataset (`PREFIX.idx` + `PREFIX.bin`), byte-compatible with Megatron-LM.

Layout of PREFIX.idx (little-endian, no padding; S sequences, D = documents + 1):

    offset 0        9 B   magic b"MMIDIDX\\x00\\x00"
    offset 9        u64   version = 1
    offset 17       u8    dtype code of the tokens in .bin (DTYPES below)
    offset 18       u64   S
    offset 26       u64   D
    offset 34       int32[S]   sequence lengths (tokens)
    34 + 4S         int64[S]   sequence pointers (byte offset of each sequence in .bin)
    34 + 12S        int64[D]   document index: document k = sequences [doc_idx[k], doc_idx[k+1]), doc_idx[-1] = S

PREFIX.bin is the tokens of all sequences back to back. Example: documents [[464, 2068], [7586, 50256]] and
[[15496, 995, 50256]] as uint16 give lengths 2,2,3, pointers 0,4,8, doc index 0,2,3 (a 94-byte .idx) and a
14-byte .bin. Megatron-LM's multimodal files (one int8 mode per sequence after the document index) are read as
plain files; the modes are ignored.
"""
import contextlib
import os
import struct

import numpy as np

from megatron.cli import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
# dtype codes of megatron-core's DType enum (old Megatron-LM read code 7 as float64; no token file uses it).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDatasetError(UserError, ValueError):
    """A .idx/.bin pair that is missing, truncated, or inconsistent; the message names the file."""


def index_file_path(prefix):
    return prefix + ".idx"


def data_file_path(prefix):
    return prefix + ".bin"


def best_fitting_dtype(vocab_size):
    """uint16 when every id fits (vocab_size < 65500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dataset_exists(prefix):
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


class MMapIndexedDataset:
    """Read-only view of PREFIX.{idx,bin} through np.memmap; checks the files before trusting them.

    ds[i] -> np.ndarray of sequence i (in the file's dtype); ds[a:b] -> list of arrays;
    ds.get(i, offset=0, length=None) -> part of sequence i; ds.sizes -> int32 lengths; ds.doc_idx -> int64.
    """

    def __init__(self, prefix):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (expected the output of tools/preprocess_data.py)")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(f"{idx_path}: truncated header ({len(header)} of {HEADER_BYTES} bytes)")
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: bad magic {header[:9]!r}, expected {MAGIC!r} "
                                      "(not a Megatron mmap indexed dataset)")
        version, = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported version {version}, expected {VERSION}")
        code = header[17]
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        self.dtype = np.dtype(DTYPES[code])
        num_sequences, num_doc_entries = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + 12 * num_sequences + 8 * num_doc_entries
        if idx_size not in (expected, expected + num_sequences):  # + S: Megatron's multimodal modes
            raise IndexedDatasetError(f"{idx_path}: size {idx_size} bytes does not match its header "
                                      f"({num_sequences} sequences, {num_doc_entries} document entries -> "
                                      f"{expected} bytes); the file is truncated or corrupt")
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buffer = self._idx_map._mmap
        self._sizes = np.frombuffer(buffer, np.int32, num_sequences, HEADER_BYTES)
        self._pointers = np.frombuffer(buffer, np.int64, num_sequences, HEADER_BYTES + 4 * num_sequences)
        self._doc_idx = np.frombuffer(buffer, np.int64, num_doc_entries, HEADER_BYTES + 12 * num_sequences)
        self._check_index(idx_path, bin_path, num_sequences)
        if os.path.getsize(bin_path) == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)

    def _check_index(self, idx_path, bin_path, num_sequences):
        doc_idx, sizes, pointers = self._doc_idx, self._sizes, self._pointers
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != num_sequences or np.any(np.diff(doc_idx) < 0):
            raise IndexedDatasetError(f"{idx_path}: document index must rise from 0 to the sequence count "
                                      f"{num_sequences}")
        if np.any(sizes < 0):
            raise IndexedDatasetError(f"{idx_path}: negative sequence length")
        ends = pointers + sizes.astype(np.int64) * self.dtype.itemsize
        if num_sequences and (pointers[0] < 0 or np.any(pointers[1:] < ends[:-1])):
            raise IndexedDatasetError(f"{idx_path}: sequence pointers overlap or go backwards")
        need = int(ends.max()) if num_sequences else 0
        have = os.path.getsize(bin_path)
        if have < need:
            raise IndexedDatasetError(f"{bin_path}: truncated: {have} bytes but {idx_path} needs {need} "
                                      f"({int(sizes.sum())} tokens of {self.dtype.name})")
        if have % self.dtype.itemsize:
            raise IndexedDatasetError(f"{bin_path}: size {have} is not a multiple of the {self.dtype.name} "
                                      "token size")

    def __len__(self):
        return len(self._sizes)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {idx} "
                             f"of length {size}")
        start = int(self._pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start) if length else np.zeros(0, self.dtype)

    @property
    def sizes(self):
        return self._sizes

    @property
    def doc_idx(self):
        return self._doc_idx

    @property
    def pointers(self):
        return self._pointers

    @staticmethod
    def exists(prefix):
        return dataset_exists(prefix)


def write_index(path, dtype, sizes, doc_idx):
    """Write a .idx file for sequences of `sizes` tokens stored back to back in .bin."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", DTYPE_CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class MMapIndexedDatasetBuilder:
    """Streams tokens into `bin_path`; `finalize(idx_path)` writes the index.

        builder = MMapIndexedDatasetBuilder("out.bin", dtype=np.uint16)
        builder.add_item([464, 2068]); builder.add_item([7586, 50256]); builder.end_document()
        builder.add_document([15496, 995, 50256], lengths=[3])   # several sequences + end_document at once
        builder.finalize("out.idx")
    """

    def __init__(self, bin_path, dtype=np.int64):
        self._bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._dtype = np.dtype(dtype)
        self._sizes = []        # list of int32 arrays, concatenated at finalize
        self._doc_ends = []     # list of int64 arrays: sequence count at the end of each document
        self._num_sequences = 0

    def _write(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.size and self._dtype.kind in "iu":
            info = np.iinfo(self._dtype)
            low, high = tokens.min(), tokens.max()
            if low < info.min or high > info.max:
                raise ValueError(f"{self._bin_path}: token id {high if high > info.max else low} does not fit "
                                 f"{self._dtype.name}")
        self._file.write(np.ascontiguousarray(tokens, dtype=self._dtype).tobytes(order="C"))

    def add_item(self, tokens):
        """Append one sequence (a list, array or 1-d tensor of ids)."""
        tokens = np.asarray(tokens).reshape(-1)
        self._write(tokens)
        self._sizes.append(np.array([tokens.size], dtype=np.int32))
        self._num_sequences += 1

    def end_document(self):
        self._doc_ends.append(np.array([self._num_sequences], dtype=np.int64))

    def add_document(self, tokens, lengths):
        """Append one document made of len(lengths) sequences whose tokens are concatenated in `tokens`."""
        self.add_documents(tokens, lengths, [len(lengths)])

    def add_documents(self, tokens, lengths, sequences_per_document):
        """Append many documents at once: all their tokens, every sequence length, sequences per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = np.asarray(tokens).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"{self._bin_path}: lengths sum to {int(lengths.sum())} but {tokens.size} tokens given")
        self._write(tokens)
        self._sizes.append(lengths.astype(np.int32))
        self._doc_ends.append(self._num_sequences + np.cumsum(sequences_per_document, dtype=np.int64))
        self._num_sequences += len(lengths)

    def merge_file_(self, another_prefix):
        """Append every sequence and document of the dataset PREFIX.{idx,bin} (same dtype required)."""
        other = MMapIndexedDataset(another_prefix)
        if other.dtype != self._dtype:
            raise ValueError(f"{index_file_path(another_prefix)}: dtype {other.dtype.name} differs from the "
                             f"builder's {self._dtype.name}")
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        self._doc_ends.append(self._num_sequences + np.array(other.doc_idx[1:], dtype=np.int64))
        self._num_sequences += len(other)
        with open(data_file_path(another_prefix), "rb") as f:
            while True:
                block = f.read(1 << 24)
                if not block:
                    break
                self._file.write(block)

    add_index = merge_file_  # megatron-core's name

    def finalize(self, idx_path):
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        doc_idx = np.concatenate([np.zeros(1, np.int64)] + self._doc_ends)
        write_index(idx_path, self._dtype, sizes, doc_idx)

    def close(self):
        """Close the .bin file without writing an index (after a failure)."""
        self._file.close()


def make_builder(bin_path, impl="mmap", vocab_size=None):
    if impl != "mmap":
        raise ValueError(f"dataset impl {impl!r} is not supported (only 'mmap')")
    return MMapIndexedDatasetBuilder(bin_path, dtype=best_fitting_dtype(vocab_size))


@contextlib.contextmanager
def building_datasets(prefixes, new_builder):
    """{key: builder} for the datasets {key: prefix}, each written under a temporary name (`new_builder(key,
    bin_path)` makes one): when the block succeeds every index is written and both files of every dataset are
    renamed into place; on an exception every temporary file is removed and nothing is left behind.

        with building_datasets({"text": prefix}, lambda key, path: make_builder(path, vocab_size=V)) as builders:
            builders["text"].add_documents(tokens, lengths, per_document)
    """
    suffix = f".tmp{os.getpid()}"
    temps = {key: (data_file_path(p) + suffix, index_file_path(p) + suffix) for key, p in prefixes.items()}
    builders = {}
    try:
        for key, (bin_tmp, _) in temps.items():
            builders[key] = new_builder(key, bin_tmp)
        yield builders
        for key, (_, idx_tmp) in temps.items():
            builders.pop(key).finalize(idx_tmp)
        for key, prefix in prefixes.items():
            os.replace(temps[key][0], data_file_path(prefix))
            os.replace(temps[key][1], index_file_path(prefix))
    finally:
        for builder in builders.values():
            builder.close()
        for paths in temps.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)


def make_dataset(prefix, impl="mmap", skip_warmup=True):
    if impl not in ("mmap", "infer"):
        raise ValueError(f"dataset impl {impl!r} is not supported (only 'mmap')")
    return MMapIndexedDataset(prefix)
