"""The stream's documents in their global order, tokenized in DataLoader worker processes.

    documents = document_loader(config, StreamPosition(epoch=0, shard=0, row=0), num_workers=2)
    for doc in documents:          # Document(epoch, shard, row, tokens or None, bad message or None), in order
        ...

Order: epoch after epoch, the shards in a per-epoch order (a permutation drawn from numpy's generator seeded with
(seed, epoch), or sorted with shuffle_shards off), each shard's rows in file order. From a position on, the
document slots are numbered j = 0, 1, 2, ...: worker w of W tokenizes slots w, w + W, ... and only counts the
others; the DataLoader asks its workers in turn (round robin, results kept in request order), so the main process
receives slot 0, 1, 2, ... in order whatever W. A slot whose text has no tokens comes back with empty tokens (the
packer passes over it, as tools/preprocess_data.py skips such a document), and so does a document of another
--split split (unread); a bad row comes back with its message.
"""
import hashlib
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from .shards import BadRecord, document_text, read_rows


@dataclass(frozen=True)
class StreamConfig:
    shards: tuple
    """The shard files (list_shards' sorted order)."""
    key: str
    """The text field (--json-keys)."""
    vocab_file: str
    merge_file: str
    append_eod: bool
    """The tokenizer's eod id after each document's tokens (tools/preprocess_data.py --append-eod)."""
    seed: int
    shuffle_shards: bool = True
    """A seeded shard order per epoch; False reads the shards sorted, every epoch."""
    split: Optional[tuple] = None
    """(low, high): only the documents whose split_point falls in [low, high) (--split by document); None: all."""


def split_point(path, row):
    """Where a document falls in [0, 1) for --split: a hash of its shard's file name and its row (not of the seed
    or the shard's directory), so a document stays in its split whatever the seed or the machine."""
    digest = hashlib.blake2b(f"{os.path.basename(path)}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2 ** 64


class StreamPosition(NamedTuple):
    epoch: int
    shard: int
    """Position in the epoch's shard order."""
    row: int
    """The next row to read in that shard."""


class Document(NamedTuple):
    epoch: int
    shard: int
    row: int
    tokens: Optional[np.ndarray]
    bad: Optional[str]


def shard_order(num_shards, seed, epoch, shuffle):
    """The shard indices of `epoch`, in reading order."""
    if not shuffle:
        return list(range(num_shards))
    return np.random.default_rng([seed, epoch]).permutation(num_shards).tolist()


def rows_from(config, position):
    """(epoch, shard position, path, row, raw) of every slot from `position` on, epoch after epoch (endless)."""
    epoch, shard, row = position
    while True:
        order = shard_order(len(config.shards), config.seed, epoch, config.shuffle_shards)
        for position_in_order in range(shard, len(order)):
            path = config.shards[order[position_in_order]]
            for slot_row, raw in read_rows(path, config.key, row):
                yield epoch, position_in_order, path, slot_row, raw
            row = 0
        shard, epoch = 0, epoch + 1


class TokenizedDocuments(torch.utils.data.IterableDataset):
    """The documents from `position` on; in a DataLoader worker, only that worker's share of the slots."""

    def __init__(self, config, position):
        self.config = config
        self.position = StreamPosition(*position)

    def __iter__(self):
        from megatron.tokenizer import GPT2BPETokenizer
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        tokenizer = GPT2BPETokenizer(self.config.vocab_file, self.config.merge_file)
        for slot, (epoch, shard, path, row, raw) in enumerate(rows_from(self.config, self.position)):
            if slot % workers != worker:
                continue
            split = self.config.split
            if split is not None and not isinstance(raw, BadRecord) and not split[0] <= split_point(path, row) < split[1]:
                yield Document(epoch, shard, row, np.zeros(0, dtype=np.int64), None)   # another split's
                continue
            text, bad = document_text(path, row, raw, self.config.key)
            tokens = None
            if bad is None:
                ids = tokenizer.tokenize(text)
                if ids and self.config.append_eod:
                    ids.append(tokenizer.eod)
                tokens = np.asarray(ids, dtype=np.int64)
            yield Document(epoch, shard, row, tokens, bad)


def _as_is(document):
    return document


def document_loader(config, position, num_workers=0):
    """An iterator over the documents from `position` on, tokenized by `num_workers` processes (0: here)."""
    loader = torch.utils.data.DataLoader(TokenizedDocuments(config, position), batch_size=None,
                                         num_workers=num_workers, collate_fn=_as_is, generator=torch.Generator())
    return iter(loader)
