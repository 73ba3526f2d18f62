"""Raw corpora as --data-path: JSON lines (.jsonl, loose .json, gzipped) and Parquet shards, tokenized while
training, resumed exactly at any data-parallel size (DESIGN.md section 18; docs/data.md "Streaming raw shards").

    train, valid, test = stream_sources(args, [n_train, n_valid, n_test])   # pretraining_datasets' for such a path
    loader = train.loader(micro_batch_size=4, data_parallel_rank=r, data_parallel_size=2, record=saved)
    batch = next(loader); record = loader.state_dict()  # saved with every checkpoint (TrainState.data_stream)

shards.py lists and reads the files, documents.py orders and tokenizes the documents (in DataLoader workers),
loader.py packs, shuffles, hands each rank its samples and keeps the position, blend.py interleaves sources.
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
    """One split of raw shards, in place of a GPTDataset: the data iterators ask it for a loader."""

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


def split_ranges(splits_string):
    """--split '949,50,1' -> the [low, high) of train, valid and test over documents' split points (Megatron's
    boundaries, at a resolution of 1e-6)."""
    from megatron.data.gpt_dataset import get_train_valid_test_split_
    bounds = [b / 1e6 for b in get_train_valid_test_split_(splits_string, 1_000_000)]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def stream_sources(args, train_valid_test_num_samples):
    """(train, valid, test) StreamSources of --data-path (a directory, glob or shard file; or a blend 'w1 P1 w2 P2
    ...' of them), split by document with --split (None for an empty split), with --json-keys, --append-eod,
    --seed, --stream-shard-order and --skip-bad-records; --stream-shuffle-buffer for the training split only."""
    words = [w for p in args.data_path for w in p.split()]
    if len(args.json_keys) != 1:
        raise StreamDataError(f"--json-keys {' '.join(args.json_keys)}: raw shards are read with one text key")
    if len(words) == 1:
        paths, weights = words, None
    else:
        from megatron.data.gpt_dataset import get_datasets_weights_and_num_samples
        paths, weights, _ = get_datasets_weights_and_num_samples(words, [1, 0, 0])
        unstreamable = [p for p in paths if not is_stream_path(p)]
        if unstreamable:
            raise StreamDataError(f"--data-path: {unstreamable[0]} is not raw shards; a blend is all raw shards or "
                                  "all .bin/.idx prefixes")
    shards = [list_shards(p) for p in paths]
    splits = []
    for index, (split, num_samples) in enumerate(zip(split_ranges(args.split), train_valid_test_num_samples)):
        if split[1] <= split[0] or num_samples <= 0:
            splits.append(None)
            continue
        sources = [_source(args, path, files, num_samples, split, index == 0) for path, files in zip(paths, shards)]
        splits.append(sources[0] if weights is None else BlendedStreamSource(sources, weights, num_samples))
    return tuple(splits)


def _source(args, path, shards, num_samples, split, training):
    config = StreamConfig(tuple(shards), args.json_keys[0], args.vocab_file, args.merge_file, args.append_eod,
                          args.seed, args.stream_shard_order == "shuffled", None if split == (0.0, 1.0) else split)
    return StreamSource(config, args.seq_length, num_samples, args.stream_shuffle_buffer if training else 0,
                        args.skip_bad_records, shards_digest(shards, path))


__all__ = ["BlendedStreamLoader", "BlendedStreamSource", "StreamConfig", "StreamDataError", "StreamLoader", "StreamPosition", "StreamSource", "is_stream_path",
           "list_shards", "split_ranges", "stream_sources", "uses_streams"]
