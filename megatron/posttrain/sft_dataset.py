"""The SFT dataset finetune_gpt.py trains on: tools/preprocess_sft_data.py's two aligned indexed datasets
(PREFIX_input_ids_document, PREFIX_loss_mask_document; one document = one example), split train/valid/test at
document level by --split, served as fixed rows of seq_length + 1 tokens.

    train, valid, test = build_sft_datasets("data/chat/chat", "949,50,1", [800, 40, 8], seq_length=128, seed=1234,
                                            pad_id=tokenizer.eod, pack=False, train_on_prompt=False)
    train[0]   # {"text", "loss_mask", "segments"}: int64 [seq_length + 1] each (sft_data.assemble_row)

A sample is one example (padded with pad_id, mask 0), or with pack=True several whole consecutive examples
(sft_data.pack_examples, next-fit) sharing a row; segments tells the examples apart (finetune_gpt.py resets
attention and positions there). An example longer than seq_length + 1 tokens is cut to its first seq_length + 1.

Order: the train split is shuffled once per epoch (numpy RandomState(seed): epoch e is the e-th permutation
drawn), as many epochs as the requested samples need; packing happens within an epoch. The first epochs do not
depend on the number requested, so a resumed run with more --train-iters sees the same early samples. Valid and
test are one pass in document order (the training loop cycles them). Everything is a pure function of the files
and the arguments: every rank builds the same index without communicating.
"""
import numpy as np

from megatron.cli import UserError
from megatron.data.corpora import DataPathError
from megatron.data.gpt_dataset import get_train_valid_test_split_
from megatron.data.indexed_dataset import (IndexedDatasetError, MMapIndexedDataset, dataset_exists, index_file_path)

from .sft_data import assemble_row, pack_examples

INPUT_IDS, LOSS_MASK = "input_ids", "loss_mask"


class SFTDataError(UserError, ValueError):
    """A split that cannot serve what the run asks of it; the message names the flags to change."""


def output_prefixes(prefix, preference=False):
    """{"input_ids": PREFIX_input_ids_document, "loss_mask": PREFIX_loss_mask_document}; preference pairs:
    PREFIX_pairs_input_ids_document and PREFIX_pairs_loss_mask_document (documents 2i and 2i + 1 are pair i's
    chosen and rejected conversations)."""
    kind = "pairs_" if preference else ""
    return {key: f"{prefix}_{kind}{key}_document" for key in (INPUT_IDS, LOSS_MASK)}


def open_sft_files(prefix, preference=False):
    """(ids dataset, mask dataset), checked to be aligned: one example per document, equal lengths (preference:
    an even number of documents, the pairs)."""
    prefixes = output_prefixes(prefix, preference)
    missing = [p for p in prefixes.values() if not dataset_exists(p)]
    if missing:
        flag = " --preference" if preference else ""
        raise DataPathError(f"--data-path {prefix}: missing {', '.join(p + '.{bin,idx}' for p in missing)}; build "
                            f"them with tools/preprocess_sft_data.py{flag} --input FILE.jsonl --output-prefix {prefix} "
                            "... (--data-path takes that --output-prefix)")
    ids, mask = MMapIndexedDataset(prefixes[INPUT_IDS]), MMapIndexedDataset(prefixes[LOSS_MASK])
    for dataset in (ids, mask):
        if not np.array_equal(dataset.doc_idx, np.arange(len(dataset) + 1)):
            raise IndexedDatasetError(f"{index_file_path(dataset.prefix)}: expected one sequence per document "
                                      "(one example each, as tools/preprocess_sft_data.py writes)")
    if len(ids) != len(mask) or not np.array_equal(ids.sizes, mask.sizes):
        raise IndexedDatasetError(f"{index_file_path(ids.prefix)} and {index_file_path(mask.prefix)} are not aligned "
                                  f"({len(ids)} and {len(mask)} examples, or lengths differ): write both with one "
                                  "run of tools/preprocess_sft_data.py")
    if preference and len(ids) % 2:
        raise IndexedDatasetError(f"{index_file_path(ids.prefix)}: {len(ids)} documents, not pairs (chosen, rejected): "
                                  "write it with tools/preprocess_sft_data.py --preference")
    return ids, mask


class SFTDataset:
    """One split: sample i is a row built from the examples self.samples[i] (document indices)."""

    def __init__(self, name, ids, mask, samples, seq_length, pad_id, train_on_prompt):
        self.name = name
        self.ids, self.mask = ids, mask
        self.samples = samples
        self.capacity = seq_length + 1
        self.pad_id = pad_id
        self.train_on_prompt = train_on_prompt

    def __len__(self):
        return len(self.samples)

    def examples(self, index):
        """[(ids, mask), ...] of sample `index`, each cut to the row."""
        return [(self.ids.get(d, 0, min(int(self.ids.sizes[d]), self.capacity)),
                 self.mask.get(d, 0, min(int(self.mask.sizes[d]), self.capacity)))
                for d in self.samples[index]]

    def __getitem__(self, index):
        return assemble_row(self.examples(index), self.capacity, self.pad_id, self.train_on_prompt)

    def describe(self):
        """One line: examples, rows, how full the rows are, examples cut."""
        documents = np.concatenate([np.asarray(s) for s in self.samples]) if self.samples else np.zeros(0, int)
        sizes = self.ids.sizes[documents].astype(np.int64) if documents.size else np.zeros(0, np.int64)
        used = int(np.minimum(sizes, self.capacity).sum())
        fill = used / max(len(self) * self.capacity, 1)
        return (f"{self.name}: {len(self)} rows of {self.capacity} tokens from {documents.size} examples "
                f"({100 * fill:.0f}% of the row tokens are example tokens; {int((sizes > self.capacity).sum())} "
                f"examples cut to {self.capacity} tokens)")


def _epoch_samples(documents, sizes, capacity, pack):
    if not pack:
        return [[int(d)] for d in documents]
    return [[int(documents[i]) for i in group] for group in pack_examples(sizes[documents], capacity)]


def split_samples(documents, sizes, num_samples, capacity, seed, pack, shuffle):
    """The samples (lists of document indices) of one split: shuffled epochs until num_samples are there, or (not
    shuffle) one pass in order."""
    documents = np.asarray(documents, dtype=np.int64)
    if not shuffle:
        return _epoch_samples(documents, sizes, capacity, pack)
    rng = np.random.RandomState(seed)
    samples = []
    while True:
        samples += _epoch_samples(rng.permutation(documents), sizes, capacity, pack)
        if len(samples) >= max(num_samples, 1):
            return samples


def build_sft_datasets(prefix, splits_string, train_valid_test_num_samples, seq_length, seed, pad_id, pack=False,
                       train_on_prompt=False, global_batch_size=1):
    """(train, valid, test) SFTDatasets; None for an empty split. SFTDataError when a validation or test split that
    is asked for samples has rows, but fewer than one global batch (the evaluation would get no batch)."""
    ids, mask = open_sft_files(prefix)
    try:
        bounds = get_train_valid_test_split_(splits_string, len(ids))
    except ValueError as error:
        raise SFTDataError(str(error)) from None
    capacity = seq_length + 1
    datasets = []
    for index, name in enumerate(("train", "valid", "test")):
        documents = np.arange(bounds[index], bounds[index + 1])
        if documents.size == 0:
            datasets.append(None)
            continue
        samples = split_samples(documents, ids.sizes, train_valid_test_num_samples[index], capacity, seed, pack,
                                shuffle=index == 0)
        if index > 0 and train_valid_test_num_samples[index] > 0 and len(samples) < global_batch_size:
            raise SFTDataError(f"--split {splits_string}: the {name} split has {len(samples)} rows ({documents.size} "
                               f"of the {len(ids)} examples), fewer than one global batch ({global_batch_size}): give "
                               f"it more (--split), or pass --eval-iters 0")
        datasets.append(SFTDataset(name, ids, mask, samples, seq_length, pad_id, train_on_prompt))
    return tuple(datasets)


class PreferenceDataset(SFTDataset):
    """One split of preference pairs: sample i is pair self.samples[i][0] as {"text", "loss_mask", "segments"}
    int64 [2, seq_length + 1] (row 0 the chosen conversation, row 1 the rejected one; assemble_row each)."""

    def __getitem__(self, index):
        (pair,) = self.samples[index]
        rows = [assemble_row([(self.ids.get(d, 0, min(int(self.ids.sizes[d]), self.capacity)),
                               self.mask.get(d, 0, min(int(self.mask.sizes[d]), self.capacity)))],
                             self.capacity, self.pad_id) for d in (2 * pair, 2 * pair + 1)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def describe(self):
        documents = np.array([d for (pair,) in self.samples for d in (2 * pair, 2 * pair + 1)], dtype=np.int64)
        sizes = self.ids.sizes[documents].astype(np.int64) if documents.size else np.zeros(0, np.int64)
        return (f"{self.name}: {len(self)} preference pairs of 2 rows of {self.capacity} tokens "
                f"({int((sizes > self.capacity).sum())} conversations cut to {self.capacity} tokens)")


def build_preference_datasets(prefix, splits_string, train_valid_test_num_samples, seq_length, seed, pad_id,
                              global_batch_size=1):
    """(train, valid, test) PreferenceDatasets of tools/preprocess_sft_data.py --preference's files, split by pairs
    (a pair never straddles two splits); None for an empty split; one sample = one pair; the same order rules as
    build_sft_datasets (train shuffled per epoch, valid and test in order)."""
    ids, mask = open_sft_files(prefix, preference=True)
    pairs = len(ids) // 2
    try:
        bounds = get_train_valid_test_split_(splits_string, pairs)
    except ValueError as error:
        raise SFTDataError(str(error)) from None
    datasets = []
    for index, name in enumerate(("train", "valid", "test")):
        documents = np.arange(bounds[index], bounds[index + 1])
        if documents.size == 0:
            datasets.append(None)
            continue
        samples = split_samples(documents, None, train_valid_test_num_samples[index], seq_length + 1, seed, False,
                                shuffle=index == 0)
        if index > 0 and train_valid_test_num_samples[index] > 0 and len(samples) < global_batch_size:
            raise SFTDataError(f"--split {splits_string}: the {name} split has {len(samples)} pairs (of {pairs}), "
                               f"fewer than one global batch ({global_batch_size}): give it more (--split), or pass "
                               "--eval-iters 0")
        datasets.append(PreferenceDataset(name, ids, mask, samples, seq_length, pad_id, False))
    return tuple(datasets)
