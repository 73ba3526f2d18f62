"""The train/valid/test data iterators of megatron/training.py's pretrain: datasets on every rank, loaders on
model-parallel rank 0 starting where the TrainState's consumed samples say (a raw-shard stream where its checkpoint record says),
the validation one restarting when it runs out."""
import itertools

import mpu
from megatron.global_vars import get_args
from megatron.trainer.fault_tolerance import sample_shard


class RestartableIterator:
    """The training loader's batches, restartable at another position (a replica group healed from a peer
    continues at the peer's consumed samples: megatron/trainer/fault_tolerance.py)."""

    def __init__(self, loader):
        self.loader, self._batches = loader, iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)

    def restart_at(self, consumed_samples):
        self.loader.batch_sampler.consumed_samples = consumed_samples
        self._batches = iter(self.loader)

    def play(self, batches, consumed_samples):
        """These micro batches (lists of sample indices) first, then the loader's from `consumed_samples` on (a
        replica group replaying dropped samples: --ft-replay-dropped)."""
        dataset, collate = self.loader.dataset, self.loader.collate_fn
        self.restart_at(consumed_samples)
        self._batches = itertools.chain([collate([dataset[i] for i in batch]) for batch in batches], self._batches)


def _data_parallel_shard(args):
    """(rank, size) the samplers read as: this rank's place in the data-parallel order of all replica groups."""
    return sample_shard(args.ft_replica_groups, args.ft_group_id, mpu.get_data_parallel_rank(),
                        mpu.get_data_parallel_world_size())


def _cyclic(loader):
    """Restart the validation loader when it runs out (validation may need more batches than one epoch)."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise RuntimeError("the validation dataset is too small for one batch")
        loader.batch_sampler.consumed_samples = 0  # a resumed run's first pass started mid-way


def _stream_iterator(source, index, train_state, args):
    """Training: the resumable stream (its record saved with every checkpoint through train_state). Validation:
    the first eval_iters steps' batches of its split, the same at every evaluation. Test: read once."""
    ranks = _data_parallel_shard(args)
    if index == 0:
        train_state.data_stream = source.loader(args.batch_size, *ranks, args.num_workers,
                                                train_state.loaded_stream_record, train_state.consumed_train_samples)
        return train_state.data_stream
    loader = source.loader(args.batch_size, *ranks)
    return _same_at_every_evaluation(loader, args.eval_iters * args.num_micro_batches) if index == 1 else loader


def _same_at_every_evaluation(loader, count):
    """The first `count` micro batches of `loader` (read at the first evaluation), then the same again and again."""
    batches = [next(loader) for _ in range(count)]
    while True:
        yield from batches


def build_train_valid_test_data_iterators(train_valid_test_dataset_provider, train_state):
    """Datasets on every rank (index building is cached and coordinated); iterators only on model-parallel
    rank 0, whose batches get_batch broadcasts to the rest of its model-parallel group. The samplers start
    where `train_state`'s consumed samples say."""
    from megatron.data.samplers import pretraining_loader, train_valid_test_num_samples
    args = get_args()
    datasets = train_valid_test_dataset_provider(train_valid_test_num_samples(
        args.train_iters, args.global_batch_size * args.ft_replica_groups, args.eval_interval, args.eval_iters))
    # Every rank builds the datasets, so these flags agree across ranks (iterators exist on mp rank 0 only).
    args.do_valid = datasets[1] is not None and len(datasets[1]) > 0 and args.eval_iters > 0
    args.do_test = datasets[2] is not None and len(datasets[2]) > 0 and args.eval_iters > 0
    iterators = []
    for index, dataset in enumerate(datasets):
        finished = index == 0 and train_state.iteration >= args.train_iters
        if dataset is None or len(dataset) == 0 or mpu.get_model_parallel_rank() != 0 or finished:
            iterators.append(None)
            continue
        if hasattr(dataset, "loader"):   # raw shards (megatron.data.stream)
            iterators.append(_stream_iterator(dataset, index, train_state, args))
            continue
        consumed = [train_state.consumed_train_samples, train_state.consumed_valid_samples % len(dataset), 0][index]
        loader = pretraining_loader(dataset, consumed, args.batch_size, *_data_parallel_shard(args), args.num_workers)
        train = RestartableIterator(loader) if args.ft_replica_groups > 1 else iter(loader)
        iterators.append(train if index == 0 else _cyclic(loader))
    return tuple(iterators)
