"""Raw corpora as --data-path: JSON lines (.jsonl, .jsonl.gz, loose .json) and Parquet shards, tokenized while
training, resumed exactly at any data-parallel size (DESIGN.md section 18; docs/data.md "Streaming raw shards").

    source = stream_source(args, num_samples)          # pretraining_datasets' training split for such a path
    loader = source.loader(micro_batch_size=4, data_parallel_rank=r, data_parallel_size=2, record=saved)
    batch = next(loader); record = loader.state_dict()  # saved with every checkpoint (TrainState.data_stream)

shards.py lists and reads the files, documents.py orders and tokenizes the documents (in DataLoader workers),
loader.py packs, shuffles, hands each rank its samples and keeps the position.
"""
from .documents import StreamConfig, StreamPosition
from .loader import StreamLoader
from .shards import StreamDataError, is_stream_path, list_shards, shards_digest


def uses_streams(data_path):
    """Whether --data-path (a list of words, as argparse gives it) names raw shards rather than .bin/.idx."""
    words = data_path.split() if isinstance(data_path, str) else [w for p in data_path for w in p.split()]
    return any(is_stream_path(w) for w in words)


class StreamSource:
    """The training split of raw shards, in place of a GPTDataset: the data iterators ask it for a loader."""

    def __init__(self, config, seq_length, num_samples, shuffle_buffer=0, skip_bad_records=False, digest=""):
        self.config, self.seq_length, self.num_samples = config, seq_length, num_samples
        self.shuffle_buffer, self.skip_bad_records, self.digest = shuffle_buffer, skip_bad_records, digest

    def __len__(self):
        return self.num_samples

    def loader(self, micro_batch_size, data_parallel_rank, data_parallel_size, num_workers=0, record=None,
               consumed_samples=0, log=print):
        """A StreamLoader after `consumed_samples` global samples: at `record` (a checkpoint's state_dict), or,
        from a checkpoint without one, by reading and dropping the consumed samples."""
        loader = StreamLoader(self.config, self.seq_length, self.shuffle_buffer, micro_batch_size,
                              data_parallel_rank, data_parallel_size, num_workers, self.skip_bad_records,
                              self.digest, log)
        if record is not None:
            loader.load_state_dict(record, consumed_samples)
        elif consumed_samples:
            if data_parallel_rank == 0:
                log(f" > the checkpoint has no data-stream record: re-reading the {consumed_samples} samples it "
                    "consumed to continue after them")
            loader.skip_samples(consumed_samples)
        return loader


def stream_source(args, num_samples):
    """The StreamSource of --data-path (one directory, glob or shard file), --json-keys, --append-eod, --seed,
    --stream-shuffle-buffer, --stream-shard-order and --skip-bad-records."""
    words = [w for p in args.data_path for w in p.split()]
    if len(words) != 1:
        raise StreamDataError(f"--data-path {' '.join(words)}: a blend of raw shards is not supported; pass one "
                              "directory, glob or shard file")
    if len(args.json_keys) != 1:
        raise StreamDataError(f"--json-keys {' '.join(args.json_keys)}: raw shards are read with one text key")
    shards = list_shards(words[0])
    config = StreamConfig(tuple(shards), args.json_keys[0], args.vocab_file, args.merge_file, args.append_eod,
                          args.seed, args.stream_shard_order == "shuffled")
    return StreamSource(config, args.seq_length, num_samples, args.stream_shuffle_buffer, args.skip_bad_records,
                        shards_digest(shards, words[0]))


__all__ = ["StreamConfig", "StreamDataError", "StreamLoader", "StreamPosition", "StreamSource", "is_stream_path",
           "list_shards", "stream_source", "uses_streams"]
