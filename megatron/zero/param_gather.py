"""Stages 1-2: the updated partitions all-gathered back after the step (pair: the owners' reduce, bucketing.py),
optionally overlapped with the next forward as Megatron-LM's distributed optimizer does (--overlap-param-gather).

A gather bucket of a FlatGroup is the same chunk [lo, hi) (at most `allgather_bucket_size` elements) of every
rank's partition, so each bucket is one all-gather of equal pieces. Flat buffer of 16 at dp = 2 (partition size
8), bucket size 3:

    flat:      [ a a a a a b b b | c c c c c c . . ]
    bucket 0:    ^ ^ ^             ^ ^ ^               chunk [0, 3) of both partitions
    bucket 1:          ^ ^ ^             ^ ^ ^         chunk [3, 6)
    bucket 2:                ^ ^               ^ ^     chunk [6, 8)
    a needs buckets 0, 1; b needs 1, 2; c needs 0, 1, 2

`launch()` starts every bucket asynchronously, in the order the forward first needs them (the parameters' module
order). With overlap the step returns with them in flight: a forward pre-hook on each module waits only for the
buckets holding that module's own parameters (and those it declares with `register_external_parameter`), so the
first layer starts as soon as its buckets are home. What writes this rank's partition (the next step, loads)
or reads the other ranks' pieces outside a forward (state_dict(), checkpoints) calls `wait_all()` first. Without
overlap the step waits for all of them at once: the same collectives, so the results are bitwise the same.
A parameter read directly (`p.data`) between step() and the next forward is not waited for: call
`engine.wait_for_parameters()` first.
"""
from .collectives import launch_gather_equal_pieces


class _Bucket:
    def __init__(self, group, lo, hi):
        self.group, self.lo, self.hi = group, lo, hi

    def pieces(self):
        size = self.group.partition_size
        return [self.group.flat[r * size + self.lo:r * size + self.hi] for r in range(self.group.num_partitions)]


def _bucket_chunks(group, start, end, bucket_size):
    """Chunk indices (buckets of `group`) that hold any element of flat range [start, end)."""
    size, chunks = group.partition_size, set()
    for rank in range(group.num_partitions):
        lo, hi = max(start, rank * size), min(end, (rank + 1) * size)
        if lo < hi:
            chunks.update(range((lo - rank * size) // bucket_size, (hi - 1 - rank * size) // bucket_size + 1))
    return chunks


class ParameterGather:
    """The gather buckets of `groups` (FlatGroups; none for stage 0 or stage 3) over `data_parallel_group`.

    `pending`: launched buckets not yet waited for, in launch order; `waited`: the buckets waited for since the
    last launch, in order (what each forward had to wait for)."""

    def __init__(self, groups, data_parallel_group, bucket_size, param_order=()):
        self.data_parallel_group = data_parallel_group
        position = {p: i for i, p in enumerate(param_order)}
        first_need, self.buckets_of, buckets = {}, {}, []
        for group in groups:
            if group.num_partitions == 1 or group.partition_size == 0:
                continue
            chunks = [_Bucket(group, lo, min(lo + bucket_size, group.partition_size))
                      for lo in range(0, group.partition_size, bucket_size)]
            buckets += chunks
            for param, (start, end) in zip(group.params, group.offsets):
                mine = [chunks[c] for c in sorted(_bucket_chunks(group, start, end, bucket_size))]
                self.buckets_of[param] = mine
                for bucket in mine:
                    first_need[bucket] = min(first_need.get(bucket, len(position)), position.get(param, len(position)))
        self.buckets = sorted(buckets, key=lambda b: first_need.get(b, len(position)))   # launch order
        self.pending = {}          # bucket -> PendingGather (dicts keep launch order)
        self.waited = []

    def launch(self):
        """Start every bucket's gather; the updated partitions must be in place (the step's last write)."""
        self.wait_all()
        self.waited = []
        for bucket in self.buckets:
            group = bucket.group.context.data_parallel_group if bucket.group.context is not None else \
                self.data_parallel_group                  # expert parameters: their own group
            self.pending[bucket] = launch_gather_equal_pieces(bucket.pieces(), group)

    def wait(self, buckets):
        """Complete `buckets` (those already complete are skipped)."""
        for bucket in buckets:
            pending = self.pending.pop(bucket, None)
            if pending is not None:
                pending.wait()
                self.waited.append(bucket)

    def wait_all(self):
        self.wait(list(self.pending))

    def buckets_needed_by(self, module):
        """The buckets holding `module`'s own parameters and its declared external ones, in launch order."""
        params = list(module.parameters(recurse=False)) + module.__dict__.get("_zero_external_params", [])
        needed = {bucket for p in params for bucket in self.buckets_of.get(p, ())}
        return [bucket for bucket in self.buckets if bucket in needed]

    def install_hooks(self, module):
        """Forward pre-hooks: every submodule waits for its own buckets; state_dict() and load_state_dict() of
        `module` (and of anything holding it) wait for all."""
        for submodule in module.modules():
            needed = self.buckets_needed_by(submodule)
            if needed:
                submodule.register_forward_pre_hook(
                    lambda _module, _inputs, needed=needed: self._before_forward(needed))
        module.register_state_dict_pre_hook(lambda *_: self.wait_all())
        module.register_load_state_dict_pre_hook(lambda *_: self.wait_all())

    def _before_forward(self, needed):
        if self.pending:            # nothing to do (the common case) costs one test
            self.wait(needed)
