"""Raw corpora as --data-path: JSON lines (.jsonl, .jsonl.gz, loose .json) and Parquet shards, tokenized while
training, resumed exactly at any data-parallel size (DESIGN.md section 18; docs/data.md "Streaming raw shards").

    source = stream_source(args, num_samples)          # pretraining_datasets' training split for such a path
    loader = source.loader(micro_batch_size=4, data_parallel_rank=r, data_parallel_size=2, record=saved)
    batch = next(loader); record = loader.state_dict()  # saved with every checkpoint (TrainState.data_stream)

shards.py lists and reads the files, documents.py orders and tokenizes the documents (in DataLoader workers),
loader.py packs, shuffles, hands each rank its samples and keeps the position.
"""
from .blend import BlendedStreamLoader
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
        return _resumed(loader, record, consumed_samples, log)


class BlendedStreamSource:
    """A weighted blend of StreamSources (megatron.data.stream.blend): the data iterators ask it for a loader."""

    def __init__(self, sources, weights, num_samples):
        self.sources, self.weights, self.num_samples = sources, weights, num_samples

    def __len__(self):
        return self.num_samples

    def loader(self, micro_batch_size, data_parallel_rank, data_parallel_size, num_workers=0, record=None,
               consumed_samples=0, log=print):
        """As StreamSource.loader; each source's stream has `num_workers` workers of its own."""
        loaders = [source.loader(1, data_parallel_rank, 1, num_workers, log=log) for source in self.sources]
        blend = BlendedStreamLoader(loaders, self.weights, micro_batch_size, data_parallel_rank, data_parallel_size)
        return _resumed(blend, record, consumed_samples, log)


def _resumed(loader, record, consumed_samples, log):
    """`loader` after `consumed_samples` global samples: at `record` (a checkpoint's state_dict), or, from a
    checkpoint without one, by reading and dropping the consumed samples."""
    if record is not None:
        loader.load_state_dict(record, consumed_samples)
    elif consumed_samples:
        if loader.data_parallel_rank == 0:
            log(f" > the checkpoint has no data-stream record: re-reading the {consumed_samples} samples it "
                "consumed to continue after them")
        loader.skip_samples(consumed_samples)
    return loader


def stream_source(args, num_samples):
    """The StreamSource of --data-path (a directory, glob or shard file; or a blend 'w1 P1 w2 P2 ...' of them),
    --json-keys, --append-eod, --seed, --stream-shuffle-buffer, --stream-shard-order and --skip-bad-records."""
    words = [w for p in args.data_path for w in p.split()]
    if len(args.json_keys) != 1:
        raise StreamDataError(f"--json-keys {' '.join(args.json_keys)}: raw shards are read with one text key")
    if len(words) == 1:
        return _single_source(args, words[0], num_samples)
    from megatron.data.gpt_dataset import get_datasets_weights_and_num_samples
    paths, weights, _ = get_datasets_weights_and_num_samples(words, [num_samples, 0, 0])
    unstreamable = [p for p in paths if not is_stream_path(p)]
    if unstreamable:
        raise StreamDataError(f"--data-path: {unstreamable[0]} is not raw shards; a blend is all raw shards or all "
                              ".bin/.idx prefixes")
    return BlendedStreamSource([_single_source(args, p, num_samples) for p in paths], weights, num_samples)


def _single_source(args, path, num_samples):
    shards = list_shards(path)
    config = StreamConfig(tuple(shards), args.json_keys[0], args.vocab_file, args.merge_file, args.append_eod,
                          args.seed, args.stream_shard_order == "shuffled")
    return StreamSource(config, args.seq_length, num_samples, args.stream_shuffle_buffer, args.skip_bad_records,
                        shards_digest(shards, path))


__all__ = ["BlendedStreamLoader", "BlendedStreamSource", "StreamConfig", "StreamDataError", "StreamLoader", "StreamPosition", "StreamSource", "is_stream_path",
           "list_shards", "stream_source", "uses_streams"]
