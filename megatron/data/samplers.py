"""Batch sampler for pretraining: resumable from the number of samples already consumed.

    sampler = MegatronPretrainingSampler(len(train_ds), consumed_samples=args.consumed_train_samples,
                                         micro_batch_size=4, data_parallel_rank=r, data_parallel_size=2)
    loader = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler)

Indices consumed_samples, consumed_samples + 1, ... are grouped into global micro batches of
micro_batch_size * data_parallel_size; rank r takes [r * micro_batch_size, (r + 1) * micro_batch_size) of each.
With micro_batch_size=2, dp=2, consumed=0: rank 0 gets [0, 1], [4, 5], ...; rank 1 gets [2, 3], [6, 7], ...
Resuming with consumed_samples=4 yields exactly the tail of that order ([4, 5] and [6, 7] next). A trailing
partial global batch is dropped (drop_last=True) or cut the same way, so a rank may get a short batch or none.
"""


class MegatronPretrainingSampler:

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                 drop_last=True):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} must be in [0, total_samples={total_samples}) "
                             "(the run has used up the dataset; ask for more samples)")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, data_parallel_size="
                             f"{data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        """Micro batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.micro_batch_times_data_parallel_size
        if self.drop_last:
            return full
        start, end = self._tail_range(remaining % self.micro_batch_times_data_parallel_size)
        return full + (1 if start < end else 0)

    def _rank_range(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def _tail_range(self, tail):
        """This rank's part of a last partial batch of `tail` samples (Megatron v2.6 semantics)."""
        start, end = self._rank_range()
        return min(start, tail), min(end, tail)

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start, end = self._rank_range()
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            start, end = self._tail_range(len(batch))
            if start < end:
                yield batch[start:end]


def train_valid_test_num_samples(train_iters, global_batch_size, eval_interval, eval_iters):
    """[train, valid, test] samples the training loop asks the dataset provider for: every training iteration's
    global batch; eval_iters batches at every eval_interval and once at the end; eval_iters test batches."""
    eval_count = (train_iters // eval_interval + 1) * eval_iters if eval_interval else 0
    return [train_iters * global_batch_size, eval_count * global_batch_size, eval_iters * global_batch_size]


def pretraining_loader(dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                       num_workers=0):
    """The DataLoader one data-parallel rank trains on, starting after `consumed_samples` (the training loop's
    and tools/print_batch.py's: one definition, so what the tool prints is what was trained on)."""
    import torch
    sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                         micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                                         data_parallel_size=data_parallel_size)
    # Its own generator: iter(loader) draws a seed, and from the global one that would shift the RNG state a
    # checkpoint restored (the iterators are built after load_checkpoint). Pinned batches on CUDA: the copy to the
    # device (mpu.broadcast_data, non_blocking) then does not wait for the host.
    import mpu
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       generator=torch.Generator(), pin_memory=mpu.get_device().type == "cuda")
