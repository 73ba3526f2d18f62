"""Flat, aligned parameter buffers and the contiguous range each data-parallel rank owns.

One `FlatGroup` per optimizer param group. Its parameters become views into one flat buffer (in the group's
parameter order), padded at the end so it splits into `dp` equal partitions of an aligned size. Example, three
parameters of 5, 3 and 6 elements, dp = 2, alignment 4:

    flat (padded to 16):  [ a a a a a b b b | c c c c c c . . ]      . = padding (always zero)
    rank 0 owns [0, 8)    -> a[0:5], b[0:3]
    rank 1 owns [8, 16)   -> c[0:6] + 2 padding elements

Only the owner keeps fp32 master weights and Adam moments for its range (stage 1) and the reduced gradients for
it (stage 2). After the step every rank's updated range is all-gathered back into the flat buffer, so the model
sees full parameters again. `ParallelContext` carries the groups the engine was given (the six mpu getters).
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from mpu.grads import duplicate_ranges
from mpu.utils import full_numel


ALIGNMENT = 32   # elements; every partition size is a multiple of it (128 bytes in fp32)


@dataclass
class ParallelContext:
    data_parallel_group: Any
    data_parallel_rank: int
    data_parallel_size: int
    model_parallel_group: Any
    model_parallel_rank: int
    model_parallel_size: int
    pipeline_parallel_group: Any = None
    """The stages of this rank's pipeline (the gradient norm and overflow span them)."""
    pipeline_parallel_size: int = 1
    pipeline_parallel_rank: int = 0
    """This rank's stage (its checkpoint files' names carry it when pipeline_parallel_size > 1)."""
    sample_parallel_size: int = None
    """Ranks that read different samples (the batch triangle's and the dataloader's dp); None: data_parallel_size.
    Fewer when the mpu object splits sequences over data-parallel ranks too (DeepSpeed's
    get_sequence_data_parallel_group: context parallelism), which then are the ranks gradients are reduced and
    partitioned over."""
    sample_parallel_rank: int = None
    expert_model_parallel_group: Any = None
    """The ranks sharing one MoE layer's experts (mpu/expert_parallel.py); None without expert parallelism."""
    expert_model_parallel_size: int = 1
    expert_data_parallel_group: Any = None
    """The ranks holding the same experts: expert parameters are partitioned and averaged over it."""
    expert_data_parallel_rank: int = 0
    expert_data_parallel_size: int = 1
    gradient_divisor: Optional[int] = None
    """What gradients are divided by before they are summed over data_parallel_group (None: its size). The experts'
    context (for_experts) divides by the whole data-parallel size: every rank's tokens reached them."""

    def __post_init__(self):
        if self.sample_parallel_size is None:
            self.sample_parallel_size, self.sample_parallel_rank = self.data_parallel_size, self.data_parallel_rank

    def for_experts(self):
        """The context expert parameters are partitioned and reduced in: the expert-data-parallel group as the
        data-parallel one (this context itself without expert parallelism)."""
        if self.expert_model_parallel_size == 1:
            return self
        return dataclasses.replace(self, data_parallel_group=self.expert_data_parallel_group,
                                   data_parallel_rank=self.expert_data_parallel_rank,
                                   data_parallel_size=self.expert_data_parallel_size,
                                   gradient_divisor=self.data_parallel_size)

    @classmethod
    def from_mpu(cls, mpu):
        """From an object with mpu's six getters (and mpu's pipeline getters, when it has them; and DeepSpeed's
        get_sequence_data_parallel_{group,rank,world_size}, the gradient group when sequences are split too);
        without one, data parallel over the whole world."""
        if mpu is not None:
            optional = {}
            stages = getattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 1)()
            if stages > 1:
                optional = {"pipeline_parallel_group": mpu.get_pipeline_model_parallel_group(),
                            "pipeline_parallel_size": stages,
                            "pipeline_parallel_rank": mpu.get_pipeline_model_parallel_rank()}
            samples = {"sample_parallel_size": mpu.get_data_parallel_world_size(),
                       "sample_parallel_rank": mpu.get_data_parallel_rank()}
            experts = getattr(mpu, "get_expert_model_parallel_world_size", lambda: 1)()
            if experts > 1:
                optional.update(expert_model_parallel_group=mpu.get_expert_model_parallel_group(),
                                expert_model_parallel_size=experts,
                                expert_data_parallel_group=mpu.get_expert_data_parallel_group(),
                                expert_data_parallel_rank=mpu.get_expert_data_parallel_rank(),
                                expert_data_parallel_size=mpu.get_expert_data_parallel_world_size())
            if hasattr(mpu, "get_sequence_data_parallel_group"):
                return cls(mpu.get_sequence_data_parallel_group(), mpu.get_sequence_data_parallel_rank(),
                           mpu.get_sequence_data_parallel_world_size(), mpu.get_model_parallel_group(),
                           mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), **optional, **samples)
            return cls(mpu.get_data_parallel_group(), mpu.get_data_parallel_rank(),
                       mpu.get_data_parallel_world_size(), mpu.get_model_parallel_group(),
                       mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), **optional, **samples)
        if dist.is_available() and dist.is_initialized():
            return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), None, 0, 1)
        return cls(None, 0, 1, None, 0, 1)


def context_of(group, ctx):
    """The ParallelContext `group` is partitioned and reduced over: its own (expert parameters') or `ctx`."""
    return group.context if group.context is not None else ctx


def context_for(params, ctx):
    """The context an optimizer param group is partitioned over: the experts' (ctx.for_experts()) when its parameters
    are expert parameters (`expert_parallel`) and there is expert parallelism, else None (ctx itself)."""
    experts = [getattr(p, "expert_parallel", False) for p in params]
    if ctx.expert_model_parallel_size == 1 or not any(experts):
        return None
    if not all(experts):
        raise ValueError("an optimizer param group mixes expert and other parameters: under expert parallelism "
                         "put the expert parameters (param.expert_parallel) in param groups of their own, as "
                         "megatron.training's optimizer does (they are reduced over another group)")
    return ctx.for_experts()


def padded_size(numel, num_partitions):
    unit = num_partitions * ALIGNMENT
    return -(-numel // unit) * unit


class FlatLayout:
    """Where each parameter of one optimizer param group sits in the group's flat order, and which contiguous
    range of it each of `num_partitions` ranks owns. Pure index arithmetic: FlatGroup (stages 0-2) adds the flat
    buffer, PartitionedGroup (stage 3) only this rank's partition.

    `num_partitions` is the data-parallel size for stages 1-3 and 1 for stage 0 (every rank owns all).
    """

    def __init__(self, params, num_partitions, rank):
        self.params = list(params)
        self.num_partitions = num_partitions
        self.rank = rank if num_partitions > 1 else 0
        self.numel = sum(full_numel(p) for p in self.params)
        self.padded_numel = padded_size(self.numel, num_partitions)
        self.partition_size = self.padded_numel // num_partitions
        self.offsets = []                 # (start, end) of each parameter in the flat buffer
        start = 0
        for p in self.params:
            self.offsets.append((start, start + full_numel(p)))
            start += full_numel(p)
        self.context = None               # the ParallelContext it is partitioned over, when not the engine's own
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of one optimizer group have mixed dtypes {sorted(map(str, dtypes))}")

    def partition_range(self, rank):
        """[start, end) of `rank`'s partition in the flat buffer (padding included)."""
        return rank * self.partition_size, (rank + 1) * self.partition_size

    @property
    def own_range(self):
        return self.partition_range(self.rank)

    def own_unpadded_range(self):
        """The part of this rank's partition that holds real parameter elements."""
        start, end = self.own_range
        return min(start, self.numel), min(end, self.numel)

    def segments(self, start, end):
        """Pieces of parameters inside flat range [start, end): (param index, lo, hi) with lo/hi flat offsets."""
        pieces = []
        for index, (s, e) in enumerate(self.offsets):
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                pieces.append((index, lo, hi))
        return pieces

    def owners(self, start, end):
        """Pieces of flat range [start, end) by owning rank: (rank, lo, hi)."""
        if self.partition_size == 0:
            return []
        first, last = start // self.partition_size, (end - 1) // self.partition_size
        return [(r, max(start, r * self.partition_size), min(end, (r + 1) * self.partition_size))
                for r in range(first, last + 1)]

    def counted_own_ranges(self, model_parallel_rank, model_parallel_size):
        """Own-partition ranges (relative to the partition) whose squares count toward the global norm.

        Parameters split across model-parallel ranks (attribute `model_parallel=True`) count on every rank,
        except the rows another rank holds too (replicated key/value heads: mpu.duplicate_ranges); duplicated
        ones only on model-parallel rank 0; a pipeline's second copy of a tied weight (`shared`) never.
        Returns (counted, not_counted) lists of (lo, hi).
        """
        start, end = self.own_range
        counted, other = [], []

        def add(target, lo, hi):
            if target and target[-1][1] == lo - start:
                target[-1] = (target[-1][0], hi - start)
            else:
                target.append((lo - start, hi - start))
        for index, lo, hi in self.segments(start, end):
            param, offset = self.params[index], self.offsets[index][0]
            if getattr(param, "shared", False):
                add(other, lo, hi)
                continue
            cursor = lo
            for a, b in duplicate_ranges(param, model_parallel_rank, model_parallel_size):
                a, b = max(offset + a, lo), min(offset + b, hi)
                if a < b:
                    if cursor < a:
                        add(counted, cursor, a)
                    add(other, a, b)
                    cursor = b
            if cursor < hi:
                add(counted, cursor, hi)
        return counted, other


class FlatGroup(FlatLayout):
    """The parameters of one optimizer param group as views into one flat buffer, split into partitions."""

    def __init__(self, params, num_partitions, rank):
        super().__init__(params, num_partitions, rank)
        device = self.params[0].device if self.params else torch.device("cpu")
        dtype = self.params[0].dtype if self.params else torch.float32
        self.flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, (s, e) in zip(self.params, self.offsets):
                self.flat[s:e].copy_(p.data.reshape(-1))
                p.data = self.flat[s:e].view_as(p)

    @property
    def dtype(self):
        return self.flat.dtype

    @property
    def device(self):
        return self.flat.device

    def own_partition(self):
        start, end = self.own_range
        return self.flat[start:end]

    def parameter_bytes(self):
        return self.flat.numel() * self.flat.element_size()
