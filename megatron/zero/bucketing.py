"""Gradient reduction: flat-bucket all-reduce (stage 0), reduce-to-owner at the boundary (stage 1), and
hook-driven buckets reduced to their owners during backward (stage 2).

Every reduction sends each flat range [lo, hi) to the rank that owns it (pair: `FlatGroup.all_gather`, which
brings the updated ranges back). Gradients are divided by the data-parallel size before they are summed, so
the owner ends up with the average and fp16 sums cannot overflow where the average would not.

Stage 2 buckets are fixed ranges of at most `reduce_bucket_size` elements of a group's flat buffer (a parameter
may span several buckets). A hook after each parameter's gradient accumulation copies its pieces into the buckets
and drops `param.grad`; a bucket whose pieces have all arrived is reduced. Buckets are launched in one fixed order
on every rank (the order their last gradient is expected in backward: reverse module order), so collectives
match across ranks even if hooks fire in a different order; a bucket that is ready early waits for its turn.
With `overlap_comm` the reductions are asynchronous and complete in `finish_micro_step()`; at most
`MAX_IN_FLIGHT` buckets are outstanding. Bucket memory: one bucket per param group being filled (a group's
bucket can wait for a late gradient while another group's fill), plus the in-flight ones with `overlap_comm`.
"""
import torch
import torch.distributed as dist

from . import offload
from .partition import context_of

MAX_IN_FLIGHT = 2


def reduce_range(flat_group, buffer, start, ctx, all_reduce, async_op):
    """Average `buffer` (flat range [start, start+len)) over data-parallel ranks; the owners get the result.

    With `all_reduce` every rank gets all of it. Returns the collective handles (empty when synchronous).
    """
    ctx = context_of(flat_group, ctx)           # expert parameters: the expert-data-parallel group
    divisor = ctx.gradient_divisor or ctx.data_parallel_size
    if ctx.data_parallel_size == 1:
        if divisor != 1:
            buffer.div_(divisor)
        return []
    buffer.div_(divisor)
    group = ctx.data_parallel_group
    if all_reduce:
        handle = dist.all_reduce(buffer, group=group, async_op=async_op)
        return [handle] if async_op else []
    handles = []
    for owner, lo, hi in flat_group.owners(start, start + buffer.numel()):
        handle = dist.reduce(buffer[lo - start:hi - start], group_dst=owner, group=group, async_op=async_op)
        if async_op:
            handles.append(handle)
    return handles


class BoundaryReducer:
    """Stages 0 and 1: gradients accumulate in one flat buffer per group (`param.grad` are views into it)
    and are reduced once per optimizer step, in chunks of `bucket_size` elements."""

    def __init__(self, groups, ctx, stage, config):
        self.groups, self.ctx, self.stage = groups, ctx, stage
        self.bucket_size = config.reduce_bucket_size
        self.all_reduce = stage == 0 or not config.reduce_scatter
        self.flat_grads = [torch.zeros_like(g.flat) for g in groups]
        self.attach_grad_views()

    def attach_grad_views(self):
        """Point every `param.grad` at its slice of the flat gradient buffer (keeps any gradient already there)."""
        for group, flat_grad in zip(self.groups, self.flat_grads):
            for p, (s, e) in zip(group.params, group.offsets):
                view = flat_grad[s:e].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view

    def finish_micro_step(self, boundary):
        if not boundary:
            return
        handles = []
        for group, flat_grad in zip(self.groups, self.flat_grads):
            for lo in range(0, group.numel, self.bucket_size):
                hi = min(lo + self.bucket_size, group.numel)
                handles += reduce_range(group, flat_grad[lo:hi], lo, self.ctx, self.all_reduce, async_op=True)
        for handle in handles:
            handle.wait()

    def partition_grad(self, index):
        start, end = self.groups[index].own_range
        return self.flat_grads[index][start:end]

    def zero(self):
        for flat_grad in self.flat_grads:
            flat_grad.zero_()

    def held_gradient_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.flat_grads)


class _Bucket:
    def __init__(self, group_index, start, end, pieces):
        self.group_index, self.start, self.end = group_index, start, end
        self.pieces = pieces                      # [(param index, flat lo, flat hi)]
        self.received = [False] * len(pieces)     # whether piece i has a gradient in this backward
        self.pending = len(pieces)
        self.launched = False
        self.handles = []


class _ContiguousStore:
    """contiguous_gradients: each piece is copied into a bucket-sized buffer from a pool as it arrives; a bucket's
    buffer goes back to the pool when its reduction completes."""

    def __init__(self, bucket_size, dtype, device, count_bytes):
        self.bucket_size, self.dtype, self.device, self.count_bytes = bucket_size, dtype, device, count_bytes
        self.free, self.taken = [], {}          # taken: bucket -> pooled buffer

    def _buffer(self, bucket):
        if bucket not in self.taken:
            if not self.free:
                self.free.append(torch.empty(self.bucket_size, dtype=self.dtype, device=self.device))
                self.count_bytes(self.bucket_size * self.free[-1].element_size())
            self.taken[bucket] = self.free.pop()
        return self.taken[bucket][:bucket.end - bucket.start]

    def add(self, bucket, piece_index, piece, seen):
        _, lo, hi = bucket.pieces[piece_index]
        target = self._buffer(bucket)[lo - bucket.start:hi - bucket.start]
        target.add_(piece) if seen else target.copy_(piece)

    def flat(self, bucket):
        """The bucket's gradients [end - start]; pieces without a gradient this backward are zero."""
        buffer = self._buffer(bucket)
        for received, (_, lo, hi) in zip(bucket.received, bucket.pieces):
            if not received:
                buffer[lo - bucket.start:hi - bucket.start].zero_()
        return buffer

    def release(self, bucket):
        self.free.append(self.taken.pop(bucket))


class _PieceStore:
    """Without contiguous_gradients: the arriving gradient slices are kept as they are and concatenated into a
    bucket buffer at launch (freed when the reduction completes)."""

    def __init__(self, dtype, device, count_bytes):
        self.dtype, self.device, self.count_bytes = dtype, device, count_bytes
        self.parts, self.flats = {}, {}         # bucket -> [slice or None]; bucket -> concatenated buffer

    def add(self, bucket, piece_index, piece, seen):
        parts = self.parts.setdefault(bucket, [None] * len(bucket.pieces))
        parts[piece_index] = parts[piece_index] + piece if seen else piece

    def flat(self, bucket):
        parts = self.parts.pop(bucket, [None] * len(bucket.pieces))
        flat = torch.cat([part if part is not None else torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
                          for part, (_, lo, hi) in zip(parts, bucket.pieces)])
        self.flats[bucket] = flat
        self.count_bytes(flat.numel() * flat.element_size())
        return flat

    def release(self, bucket):
        flat = self.flats.pop(bucket)
        self.count_bytes(-flat.numel() * flat.element_size())


def _partition_gradient(group, gradient_device, pin_memory=False):
    """The zeroed reduced-gradient partition of `group`: host offload memory when `gradient_device` is given or the
    group's partition is offloaded (offload_param), else beside the partition. `pin_memory` (an offload block's
    pin_memory, as DeepSpeed): page-locked on CUDA, so the reduced pieces' device-to-host copies run at full speed."""
    if gradient_device is not None or getattr(group, "offloaded", False):
        return offload.host_zeros(group.partition_size, group.dtype, pin_memory)
    return torch.zeros(group.partition_size, dtype=group.dtype, device=group.device)


class BucketReducer:
    """Stage 2: each rank holds only the reduced gradients of its own partition (`partition_grad`)."""

    def __init__(self, groups, ctx, config, param_order, collective_device, gradient_device=None):
        """`collective_device`: where the buckets are filled and reduced (the compute device: NCCL takes device
        tensors only, also when the partitions live in host memory under offload_param); `gradient_device`:
        where the reduced partition gradients live (the host with offload_optimizer, allocated as offload memory;
        None: the partitions' device, which is the host under offload_param)."""
        self.groups, self.ctx = groups, ctx
        self.bucket_size = config.reduce_bucket_size
        self.overlap = config.overlap_comm
        self.all_reduce = not config.reduce_scatter
        pin_memory = any(block is not None and block.enabled and block.pin_memory
                         for block in (config.offload_optimizer, config.offload_param))
        self.partition_grads = [_partition_gradient(g, gradient_device, pin_memory) for g in groups]
        self.buckets = self._build_buckets(param_order)
        self.pieces_of = {}          # param -> [(bucket, piece index)]
        for bucket in self.buckets:
            for piece_index, (param_index, _, _) in enumerate(bucket.pieces):
                param = groups[bucket.group_index].params[param_index]
                self.pieces_of.setdefault(param, []).append((bucket, piece_index))
        sample = next((g for g in groups if g.numel > 0), None)
        dtype = sample.dtype if sample is not None else torch.float32
        pool_size = min(self.bucket_size, max((g.numel for g in groups), default=0))
        self.store = (_ContiguousStore(pool_size, dtype, collective_device, self._count) if config.contiguous_gradients
                      else _PieceStore(dtype, collective_device, self._count))
        self.in_flight = []
        self.next_launch = 0
        self.peak_bucket_bytes = 0
        self._live_bucket_bytes = 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.pieces_of]

    def _build_buckets(self, param_order):
        """Ranges of at most bucket_size elements, from the end of each flat buffer, ordered by when their
        last gradient is expected (reverse module order)."""
        backward_position = {p: i for i, p in enumerate(reversed(list(param_order)))}
        buckets = []
        for gi, group in enumerate(self.groups):
            end = group.numel
            while end > 0:
                start = max(0, end - self.bucket_size)
                buckets.append(_Bucket(gi, start, end, group.segments(start, end)))
                end = start

        def completion(bucket):
            params = self.groups[bucket.group_index].params
            return max(backward_position.get(params[i], len(backward_position)) for i, _, _ in bucket.pieces)
        return sorted(buckets, key=completion)

    def _on_grad(self, param):
        grad = param.grad.reshape(-1)
        for bucket, piece_index in self.pieces_of[param]:
            if bucket.launched:
                raise RuntimeError("a parameter received a second gradient after its bucket was reduced in this "
                                   "backward pass; stage 2 needs each parameter's gradient once per backward")
            index, lo, hi = bucket.pieces[piece_index]
            param_start = self.groups[bucket.group_index].offsets[index][0]
            seen = bucket.received[piece_index]
            self.store.add(bucket, piece_index, grad[lo - param_start:hi - param_start], seen)
            if not seen:
                bucket.received[piece_index] = True
                bucket.pending -= 1
            self._launch_ready()          # frees the buffer (synchronous mode) before the next piece needs one
        param.grad = None

    def _launch_ready(self, force=False):
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.pending and not force:
                return
            self._launch(bucket)
            self.next_launch += 1

    def _launch(self, bucket):
        bucket.launched = True
        flat = self.store.flat(bucket)
        bucket.handles = reduce_range(self.groups[bucket.group_index], flat, bucket.start, self.ctx,
                                      self.all_reduce, async_op=self.overlap)
        self.in_flight.append((bucket, flat))
        while len(self.in_flight) > (MAX_IN_FLIGHT if self.overlap else 0):
            self._complete(*self.in_flight.pop(0))

    def _complete(self, bucket, flat):
        """Wait for `bucket`'s reduction and add this rank's piece of it to the partition gradient."""
        for handle in bucket.handles:
            handle.wait()
        group = self.groups[bucket.group_index]
        own_start, own_end = group.own_range
        lo, hi = max(bucket.start, own_start), min(bucket.end, own_end)
        if lo < hi:
            target = self.partition_grads[bucket.group_index][lo - own_start:hi - own_start]
            target.add_(flat[lo - bucket.start:hi - bucket.start].to(target.device))   # to the host when offloaded
        self.store.release(bucket)
        bucket.handles = []

    def _reset_buckets(self):
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.pieces), False
            bucket.received = [False] * len(bucket.pieces)

    def _count(self, nbytes):
        self._live_bucket_bytes += nbytes
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self._live_bucket_bytes)

    def finish_micro_step(self, boundary):
        """After backward: reduce buckets still waiting (missing gradients count as zero), wait for all."""
        self._launch_ready(force=True)
        while self.in_flight:
            self._complete(*self.in_flight.pop(0))
        self.next_launch = 0
        self._reset_buckets()

    def partition_grad(self, index):
        return self.partition_grads[index]

    def zero(self):
        for grad in self.partition_grads:
            grad.zero_()

    def held_gradient_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.partition_grads)
