"""The training stream: documents packed into seq_length + 1 windows, an optional seeded shuffle buffer, and each
data-parallel rank's part of every global micro batch; its position saved with every checkpoint.

    loader = StreamLoader(config, seq_length=1024, shuffle_buffer=0, micro_batch_size=4, data_parallel_rank=r,
                          data_parallel_size=2, num_workers=2)
    batch = next(loader)             # {"text": int64 [4, 1025]}: this rank's samples of the next global micro batch
    record = loader.state_dict()     # the stream's position: saved with the checkpoint (TrainState.to_state)

Global sample g is a function of the seed and g alone: every rank reads the whole global stream (documents in
megatron.data.stream.documents' order, windows cut as GPTDataset cuts doc_idx's tokens: window k = stream tokens
[k*L, k*L + L + 1], each starting at the last token of the one before), and of each global micro batch of
micro_batch_size * dp samples rank r takes [r * micro_batch_size, (r + 1) * micro_batch_size) as Megatron's
sampler does. So the global batches are the same at any dp size, and a checkpoint's record (whose position is
global) resumes at any dp or model-parallel size at the same global sample.

Shuffle buffer of N (0 = none): the first N windows fill it; then each new window replaces the buffered one at
index default_rng([seed, g]).integers(N), which is emitted as global sample g.
"""
import numpy as np
import torch

from .documents import StreamPosition, document_loader
from .shards import StreamDataError

STATE_VERSION = 1
_CHECKED_FIELDS = ("seq_length", "shuffle_buffer", "seed", "shuffle_shards", "append_eod", "key", "shards",
                   "shards_digest")


class Packer:
    """Documents' tokens -> windows of seq_length + 1 tokens; window k+1 starts at window k's last token."""

    def __init__(self, seq_length, carry=None):
        self.window = seq_length + 1
        self.carry = np.zeros(0, dtype=np.int64) if carry is None else np.asarray(carry, dtype=np.int64)

    def add(self, tokens):
        self.carry = np.concatenate([self.carry, tokens])

    def take(self):
        """The next window, or None until enough tokens were added."""
        if len(self.carry) < self.window:
            return None
        window, self.carry = self.carry[:self.window].copy(), self.carry[self.window - 1:]
        return window


class ShuffleBuffer:
    """Bounded shuffle whose draw for global sample g is a function of (seed, g) only."""

    def __init__(self, size, seed, samples=None):
        self.size, self.seed = size, seed
        self.samples = [] if samples is None else list(samples)

    def exchange(self, window, index):
        """Put `window` in; the window to emit as global sample `index`, or None while the buffer fills."""
        if self.size == 0:
            return window
        if len(self.samples) < self.size:
            self.samples.append(window)
            return None
        slot = int(np.random.default_rng([self.seed, index]).integers(self.size))
        emitted, self.samples[slot] = self.samples[slot], window
        return emitted


class RankBatches:
    """An endless iterator over this data-parallel rank's micro batches of a global sample stream (`next_sample`):
    of each global micro batch of micro_batch_size * dp samples, rank r takes [r * mb, (r + 1) * mb)."""

    def __iter__(self):
        return self

    def __next__(self):
        global_batch = [self.next_sample() for _ in range(self.micro_batch_size * self.data_parallel_size)]
        start = self.data_parallel_rank * self.micro_batch_size
        return {"text": torch.from_numpy(np.stack(global_batch[start:start + self.micro_batch_size]))}

    def skip_samples(self, count):
        """Read and drop `count` global samples (a checkpoint without the stream's record: same order, re-read)."""
        for _ in range(count):
            self.next_sample()


class StreamLoader(RankBatches):
    """This data-parallel rank's micro batches of the global stream (an endless iterator), resumable."""

    def __init__(self, config, seq_length, shuffle_buffer, micro_batch_size, data_parallel_rank, data_parallel_size,
                 num_workers=0, skip_bad_records=False, shards_digest="", log=print):
        self.config, self.seq_length, self.num_workers = config, seq_length, num_workers
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.skip_bad_records, self.shards_digest, self.log = skip_bad_records, shards_digest, log
        self.position = StreamPosition(0, 0, 0)
        self.packer = Packer(seq_length)
        self.buffer = ShuffleBuffer(shuffle_buffer, config.seed)
        self.samples = 0          # global samples emitted
        self.bad_records = 0
        self._documents = None    # the document iterator, started at self.position on first use
        self._epoch_had_tokens = True

    def next_sample(self):
        """Global sample number self.samples (then counted)."""
        while True:
            window = self.packer.take()
            while window is None:
                self._read_document()
                window = self.packer.take()
            emitted = self.buffer.exchange(window, self.samples)
            if emitted is not None:
                self.samples += 1
                return emitted

    def _read_document(self):
        if self._documents is None:
            self._documents = document_loader(self.config, self.position, self.num_workers)
        doc = next(self._documents)
        if doc.epoch != self.position.epoch:
            if not self._epoch_had_tokens:
                split = self.config.split
                within = f" in the --split range [{split[0]:.4f}, {split[1]:.4f})" if split else ""
                raise StreamDataError(f"a whole epoch of the {len(self.config.shards)} shards gave no tokens{within} "
                                      "(every document empty, bad or in another split): check the data and --split")
            self._epoch_had_tokens = False
        self.position = StreamPosition(doc.epoch, doc.shard, doc.row + 1)
        if doc.bad is not None:
            if not self.skip_bad_records:
                raise StreamDataError(f"{doc.bad} (--skip-bad-records skips and counts such records)")
            self.bad_records += 1
            if self.data_parallel_rank == 0:
                self.log(f" > skipped bad record {self.bad_records}: {doc.bad}")
            return
        if len(doc.tokens):
            self._epoch_had_tokens = True
            self.packer.add(doc.tokens)

    def _settings(self):
        c = self.config
        return {"seq_length": self.seq_length, "shuffle_buffer": self.buffer.size, "seed": c.seed,
                "shuffle_shards": c.shuffle_shards, "append_eod": c.append_eod, "key": c.key,
                "shards": len(c.shards), "shards_digest": self.shards_digest}

    def state_dict(self):
        """The stream's position after the samples emitted so far (plain types and tensors: weights_only loads)."""
        buffered = (torch.from_numpy(np.stack(self.buffer.samples)) if self.buffer.samples
                    else torch.zeros(0, self.seq_length + 1, dtype=torch.int64))
        return {"version": STATE_VERSION, **self._settings(), "epoch": self.position.epoch,
                "shard": self.position.shard, "row": self.position.row, "samples": self.samples,
                "bad_records": self.bad_records, "carry": torch.from_numpy(self.packer.carry.copy()),
                "buffer": buffered}

    def load_state_dict(self, record, consumed_samples):
        """Continue after `record` (state_dict's); the run's consumed samples must be the record's."""
        if record.get("version") != STATE_VERSION:
            raise StreamDataError(f"the checkpoint's data-stream record has version {record.get('version')}, this "
                                  f"code reads version {STATE_VERSION}")
        ours = self._settings()
        for field in _CHECKED_FIELDS:
            if record[field] != ours[field]:
                raise StreamDataError(f"the checkpoint's data stream was read with {field} {record[field]!r}, this "
                                      f"run has {ours[field]!r}: resume with the same data flags")
        if record["samples"] != consumed_samples:
            raise StreamDataError(f"the checkpoint's data stream emitted {record['samples']} samples but its "
                                  f"counters consumed {consumed_samples}: the checkpoint is inconsistent")
        self.position = StreamPosition(record["epoch"], record["shard"], record["row"])
        self.packer = Packer(self.seq_length, record["carry"].numpy())
        self.buffer = ShuffleBuffer(self.buffer.size, self.config.seed, list(record["buffer"].numpy()))
        self.samples, self.bad_records = record["samples"], record["bad_records"]
        self._documents = None
