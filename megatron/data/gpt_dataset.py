"""GPT pretraining samples from indexed datasets: Megatron-LM's split, doc/sample/shuffle indices and blending.

    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        ["data/webtext/webtext_text_document"], "949,50,1", [8000, 1100, 80], seq_length=256, seed=1234)
    train_ds[0]["text"]   # np.int64 array of seq_length + 1 tokens: tokens = x[:-1], labels = x[1:]

How a split becomes samples (Megatron-LM v2.6 == megatron-core; details in ../shared/FORMAT.md section 2):
  1. The split is a range of sequences of the indexed dataset (documents, or sentences with --split-sentences).
  2. doc_idx: the split's sequence ids repeated for enough epochs to give the requested samples, shuffled with
     RandomState(seed) (the last epoch separately when it supplies < 80% of an epoch's samples).
  3. sample_idx[k] = (position in doc_idx, token offset) where sample k starts: the stream of doc_idx's tokens cut
     every seq_length tokens; sample k is stream[k*L : k*L + L + 1] (the last token is the next sample's first).
  4. shuffle_idx: a permutation of the samples, from the same RandomState; dataset[i] = sample shuffle_idx[i].
  E.g. L=4, documents of 3 and 6 tokens, doc_idx = [1, 0]: stream = d1[0..5] d0[0..2], 2 samples,
  sample_idx = [(0,0), (0,4), (1,2)]: sample 0 = d1[0:5], sample 1 = d1[4:6] + d0[0:3].

The index arrays are cached as .npy next to the data (or under data_cache_path), named by a hash of every input
(the prefix, its .idx contents, the split's documents, num_samples, seq_length, seed, the algorithm version),
written under temporary names and renamed. With torch.distributed initialized, rank 0 of `group` builds them
while the other ranks wait at a barrier, then every rank memory-maps them; without it, a file lock makes racing
processes build once.
"""
import fcntl
import functools
import hashlib
import json
import math
import os
import time

import numpy as np

from megatron.checkpoint.atomic_io import agree_on_success, atomic_path

from .indexed_dataset import MMapIndexedDataset, index_file_path

INDEX_VERSION = "megatron-v2.6-gpt-indexmap-1"


# ---------------------------------------------------------------------------------------------- split and blend
def get_train_valid_test_split_(splits_string, size):
    """Megatron v2.6: '949,50,1' (or '949/50/1', or one number) -> boundaries [0, b1, b2, size] over `size`."""
    if "," in splits_string:
        parts = splits_string.split(",")
    elif "/" in splits_string:
        parts = splits_string.split("/")
    else:
        parts = [splits_string]
    try:
        splits = [float(s) for s in parts]
    except ValueError:
        raise ValueError(f"--split {splits_string!r}: expected up to three numbers like '949,50,1'") from None
    if len(splits) > 3 or any(s < 0 for s in splits) or sum(splits) <= 0:
        raise ValueError(f"--split {splits_string!r}: expected up to three non-negative weights with a positive sum")
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    splits = [s / total for s in splits]
    index = [0]
    for s in splits:
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    return index


def get_datasets_weights_and_num_samples(data_prefix, train_valid_test_num_samples):
    """'w1 p1 w2 p2 ...' -> (prefixes, normalized weights, per-prefix samples = ceil(n * w * 1.005))."""
    if len(data_prefix) % 2:
        raise ValueError(f"--data-path {' '.join(data_prefix)}: a blend is 'weight prefix weight prefix ...'")
    try:
        weights = [float(w) for w in data_prefix[0::2]]
    except ValueError:
        raise ValueError(f"--data-path {' '.join(data_prefix)}: a blend is 'weight prefix weight prefix ...'") from None
    prefixes = [p.strip() for p in data_prefix[1::2]]
    total = sum(weights)
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"--data-path: blend weights must be non-negative with a positive sum, got {weights}")
    weights = [w / total for w in weights]
    per_dataset = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples] for w in weights]
    return prefixes, weights, per_dataset


def build_blending_indices(weights, size):
    """Megatron's greedy interleave: sample i goes to the dataset furthest below its share (ties: lowest index).

    Returns (dataset_index uint8, dataset_sample_index int64)."""
    weights = [float(w) for w in weights]
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * len(weights)
    for i in range(size):
        denominator = max(float(i), 1.0)
        errors = [w * denominator - c for w, c in zip(weights, current)]
        best = errors.index(max(errors))
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


class BlendableDataset:
    """Interleaves datasets in proportion to weights (Megatron v2.6 BlendableDataset)."""

    def __init__(self, datasets, weights):
        self.datasets = datasets
        self.size = sum(len(d) for d in datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, self.size)

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]


# ---------------------------------------------------------------------------------------------- index arrays
def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    """Smallest e with (e * T - 1) // L >= num_samples."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"the split has {tokens_per_epoch} tokens: too few for any sample")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch):
    """documents repeated num_epochs times and shuffled (last epoch shuffled on its own when separate)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = build_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Vectorized helpers.cpp::build_sample_idx: [n + 1, 2] (doc_idx position, offset) of each sample start.

    Sample k starts at stream token k * seq_length; its row is the doc_idx entry holding that token (zero-length
    documents are passed over) and the offset inside it. Row 0 is (0, 0) as in Megatron."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = np.asarray(sizes)[doc_idx].astype(np.int64)
    doc_ends = np.cumsum(doc_lengths)                                    # stream position after each entry
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(doc_ends, starts, side="right")           # first entry ending after the start
    offset = starts - (doc_ends[position] - doc_lengths[position])
    dtype = np.int32 if max(len(doc_idx), int(doc_lengths.max(initial=0))) < np.iinfo(np.int32).max else np.int64
    sample_idx = np.stack([position, offset], axis=1).astype(dtype)
    sample_idx[0] = 0
    return sample_idx


def build_shuffle_idx(num_samples, total_size, np_rng):
    """Permutation of range(total_size): the first num_samples shuffled, then the rest shuffled separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_arrays(sizes, documents, num_samples, seq_length, seed):
    """(doc_idx, sample_idx, shuffle_idx) for one split, exactly as Megatron-LM v2.6 _build_index_mappings."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    np_rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    if num_epochs > 1:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - from_epochs_minus_one
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = last_epoch_samples < int(0.80 * per_epoch)
    doc_idx = build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = from_epochs_minus_one if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(first, total, np_rng)
    return doc_idx, sample_idx, shuffle_idx


# ---------------------------------------------------------------------------------------------- cache
@functools.lru_cache(maxsize=64)
def _file_md5(path, size, mtime_ns):
    """md5 of a file, remembered per (path, size, mtime) so the three splits hash a large .idx once."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def _cache_description(prefix, name, documents, num_samples, seq_length, seed):
    stat = os.stat(index_file_path(prefix))
    idx_digest = _file_md5(os.path.abspath(index_file_path(prefix)), stat.st_size, stat.st_mtime_ns)
    return {"version": INDEX_VERSION, "prefix": os.path.abspath(prefix), "idx_md5": idx_digest, "split": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed)}


def cache_paths(prefix, name, description, data_cache_path=None):
    """{'doc', 'sample', 'shuffle', 'description'} -> file path, named by the md5 of the description."""
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    directory = data_cache_path or os.path.dirname(os.path.abspath(prefix))
    base = os.path.join(directory, f"{os.path.basename(prefix)}_{name}_indexmap_{description['num_samples']}ns_"
                                   f"{description['seq_length']}sl_{description['seed']}s_{digest[:16]}")
    paths = {kind: f"{base}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")}
    paths["description"] = f"{base}_description.json"
    return paths


def _build_and_save(paths, description, sizes, documents, num_samples, seq_length, seed):
    """Build under an exclusive file lock, unless another process finished meanwhile. The description file is
    renamed last: its presence means the three arrays are complete."""
    os.makedirs(os.path.dirname(paths["doc"]), exist_ok=True)
    lock_path = paths["description"] + ".lock"
    built = False
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(paths["description"]):
            start = time.time()
            arrays = build_index_arrays(sizes, documents, num_samples, seq_length, seed)
            for kind, array in zip(("doc", "sample", "shuffle"), arrays):
                with atomic_path(paths[kind]) as tmp:
                    _save_npy(tmp, array)
            description = dict(description, build_seconds=round(time.time() - start, 3))
            with atomic_path(paths["description"]) as tmp:
                _save_json(tmp, description)
            built = True
        # The description exists now, so whoever takes any lock on this name next returns without building:
        # removing the lock file cannot let two builders run at once.
        try:
            os.remove(lock_path)
        except FileNotFoundError:
            pass
    return built


def _save_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def _save_npy(path, array):
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)


def _distributed_rank_and_agree(group):
    """(rank in `group`, agree(error)): agree is where the ranks meet after rank 0's build; when rank 0 failed,
    every rank raises instead of waiting for index files that will never appear."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, _raise_if

    def agree(error):
        from mpu import get_device
        agree_on_success(error, "building the dataset index mappings failed on rank 0", get_device(), group=group,
                         error_class=None)
    return dist.get_rank(group=group), agree


def _raise_if(error):
    if error is not None:
        raise error


def get_index_mappings(prefix, sizes, name, documents, num_samples, seq_length, seed, data_cache_path=None,
                       group=None):
    """Load (or build once and cache) the split's (doc_idx, sample_idx, shuffle_idx), memory-mapped read-only."""
    description = _cache_description(prefix, name, documents, num_samples, seq_length, seed)
    paths = cache_paths(prefix, name, description, data_cache_path)
    rank, agree = _distributed_rank_and_agree(group)
    error = None
    if rank == 0 and not os.path.exists(paths["description"]):
        try:
            if _build_and_save(paths, description, sizes, documents, num_samples, seq_length, seed):
                print(f" > built {name} index mappings for {prefix} ({num_samples} samples): "
                      f"{paths['description']}", flush=True)
        except Exception as e:  # re-raised on rank 0 by agree, after telling the other ranks
            error = e
    agree(error)
    if not os.path.exists(paths["description"]):  # another node without a shared file system
        _build_and_save(paths, description, sizes, documents, num_samples, seq_length, seed)
    return tuple(np.load(paths[kind], mmap_mode="r", allow_pickle=False) for kind in ("doc", "sample", "shuffle"))


# ---------------------------------------------------------------------------------------------- datasets
class GPTDataset:
    """Samples of seq_length + 1 tokens from the sequences `documents` of an indexed dataset."""

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length, seed,
                 data_cache_path=None, group=None):
        self.name = name
        self.indexed_dataset = indexed_dataset
        if len(documents) == 0 or documents[0] < 0 or documents[-1] >= len(indexed_dataset):
            raise ValueError(f"{data_prefix}: {name} split has no documents (check --split)")
        self.doc_idx, self.sample_idx, self.shuffle_idx = get_index_mappings(
            data_prefix, indexed_dataset.sizes, name, documents, num_samples, seq_length, seed,
            data_cache_path, group)

    def __len__(self):
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx):
        idx = int(self.shuffle_idx[idx])
        doc_f, offset_f = (int(v) for v in self.sample_idx[idx])
        doc_l, offset_l = (int(v) for v in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            sample = get(int(self.doc_idx[doc_f]), offset=offset_f, length=offset_l - offset_f + 1)
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=offset_f)]
            parts += [get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), length=offset_l + 1))
            sample = np.concatenate(parts)
        return {"text": np.array(sample, dtype=np.int64)}


def _build_single_prefix(prefix, splits_string, num_samples, seq_length, seed, data_cache_path, group):
    indexed_dataset = MMapIndexedDataset(prefix)
    total = len(indexed_dataset)
    bounds = get_train_valid_test_split_(splits_string, total)
    datasets = []
    for i, name in enumerate(("train", "valid", "test")):
        if bounds[i + 1] > bounds[i] and num_samples[i] > 0:
            documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
            datasets.append(GPTDataset(name, prefix, documents, indexed_dataset, num_samples[i], seq_length, seed,
                                       data_cache_path, group))
        else:
            datasets.append(None)
    return tuple(datasets)


def build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples, seq_length, seed,
                                    data_cache_path=None, group=None):
    """Train, valid and test datasets (each a GPTDataset, a BlendableDataset or None for an empty split).

    data_prefix: a prefix string, [prefix], or a blend ['w1', 'p1', 'w2', 'p2', ...].
    splits_string: '949,50,1'. train_valid_test_num_samples: samples requested per split (each split builds whole
    epochs, so it can be longer). group: the process group whose rank 0 builds the cache (default: all ranks);
    every rank of the group must call this.
    """
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    data_prefix = list(data_prefix)
    if len(data_prefix) == 1:
        return _build_single_prefix(data_prefix[0], splits_string, train_valid_test_num_samples, seq_length, seed,
                                    data_cache_path, group)
    prefixes, weights, per_dataset = get_datasets_weights_and_num_samples(data_prefix, train_valid_test_num_samples)
    built = [_build_single_prefix(p, splits_string, n, seq_length, seed, data_cache_path, group)
             for p, n in zip(prefixes, per_dataset)]
    blended = []
    for split in range(3):
        parts = [(ds[split], w) for ds, w in zip(built, weights) if ds[split] is not None]
        blended.append(BlendableDataset([d for d, _ in parts], [w for _, w in parts]) if parts else None)
    return tuple(blended)
