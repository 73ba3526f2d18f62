"""Expert-parallel process groups and the all-to-all that carries tokens to their experts and back.

Expert parallelism (Megatron-LM's --expert-model-parallel-size EP) splits each MoE layer's experts over EP
consecutive ranks of a data-parallel group: the expert-model-parallel group. Ranks at the same position of the
expert-model-parallel groups of one data-parallel group hold the same experts: they form the expert-data-parallel
group, over which those experts' gradients are averaged and ZeRO partitions their optimizer state. Example, 8 ranks,
tensor-parallel size 2 (data-parallel size 4), EP = 2:

    data-parallel groups:           [0 2 4 6] [1 3 5 7]
    expert-model-parallel groups:   [0 2] [4 6] [1 3] [5 7]      (experts 0..E/2-1 on 0, 4, 1, 5; the rest on 2, 6, 3, 7)
    expert-data-parallel groups:    [0 4] [2 6] [1 5] [3 7]
    rank 6: expert-model-parallel rank 1, expert-data-parallel rank 1

Tensor parallelism splits each expert as it splits a dense MLP (its ranks hold the same tokens and send them to
expert-parallel peers of the same tensor-parallel rank). Before initialize_expert_parallel (or at EP = 1) the
getters answer EP = 1: the experts are replicated over the data-parallel group, which is then also the
expert-data-parallel group.

all_to_all(x, output_splits, input_splits, group) is its own pair: its backward is the all-to-all with the splits
swapped. Every rank calls it with its own (possibly zero) split sizes; empty pieces are normal.
"""
import torch
import torch.distributed as dist

from .initialize import get_data_parallel_group, get_data_parallel_rank, get_data_parallel_world_size

_EXPERT_MODEL_PARALLEL_GROUP = None
_EXPERT_MODEL_PARALLEL_RANKS = None
_EXPERT_DATA_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_RANKS = None


def expert_parallel_layout(data_parallel_ranks, expert_model_parallel_size):
    """(expert-model-parallel groups, expert-data-parallel groups) of one data-parallel group's global ranks (in
    data-parallel rank order): consecutive blocks of EP, and the ranks at the same position of the blocks."""
    ep = expert_model_parallel_size
    blocks = [list(data_parallel_ranks[i:i + ep]) for i in range(0, len(data_parallel_ranks), ep)]
    return blocks, [[block[j] for block in blocks] for j in range(ep)]


def initialize_expert_parallel(expert_model_parallel_size, timeout=None):
    """Build the expert groups of every data-parallel group (mpu.initialize_model_parallel first). Collective:
    every rank calls it, in the same order. EP must divide the data-parallel size."""
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS
    global _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS
    assert _EXPERT_MODEL_PARALLEL_RANKS is None, "expert-parallel groups are already initialized"
    ep, dp = expert_model_parallel_size, get_data_parallel_world_size()
    if ep < 1 or dp % ep:
        raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp})")
    # every data-parallel group's ranks, from every rank (new_group must be called for every group everywhere)
    mine = dist.get_process_group_ranks(get_data_parallel_group())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = dist.get_rank()
    for data_parallel_ranks in sorted({tuple(ranks) for ranks in every}):
        model_groups, data_groups = expert_parallel_layout(data_parallel_ranks, ep)
        for ranks in model_groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS = group, ranks
        for ranks in data_groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS = group, ranks


def destroy_expert_parallel():
    """Forget the expert groups (mpu.destroy_model_parallel calls it)."""
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS
    global _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS
    _EXPERT_MODEL_PARALLEL_GROUP = _EXPERT_MODEL_PARALLEL_RANKS = None
    _EXPERT_DATA_PARALLEL_GROUP = _EXPERT_DATA_PARALLEL_RANKS = None


def get_expert_model_parallel_group():
    """The ranks sharing one MoE layer's experts; None at EP = 1."""
    return _EXPERT_MODEL_PARALLEL_GROUP if get_expert_model_parallel_world_size() > 1 else None


def get_expert_model_parallel_world_size():
    return len(_EXPERT_MODEL_PARALLEL_RANKS) if _EXPERT_MODEL_PARALLEL_RANKS is not None else 1


def get_expert_model_parallel_rank():
    """Which slice of the experts this rank holds (0 at EP = 1)."""
    return _EXPERT_MODEL_PARALLEL_RANKS.index(dist.get_rank()) if _EXPERT_MODEL_PARALLEL_RANKS is not None else 0


def get_expert_data_parallel_group():
    """The ranks holding the same experts (the data-parallel group at EP = 1)."""
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_group()
    return _EXPERT_DATA_PARALLEL_GROUP


def get_expert_data_parallel_world_size():
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_world_size()
    return len(_EXPERT_DATA_PARALLEL_RANKS)


def get_expert_data_parallel_rank():
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_rank()
    return _EXPERT_DATA_PARALLEL_RANKS.index(dist.get_rank())


def is_expert_parameter(param):
    """A parameter of an expert (its gradient is averaged over the expert-data-parallel group, not the
    data-parallel one; mpu.moe marks them)."""
    return getattr(param, "expert_parallel", False)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(input_splits), ...] -> [sum(output_splits), ...]: input_splits[r] rows go to rank r, output_splits[r]
    come from it. Backward: the gradients go back the same way (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        output = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(output, x.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x, output_splits, input_splits, group):
    """Exchange rows of x over `group` (see _AllToAll); x itself when the group is a single rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def exchange_counts(counts, group):
    """counts [EP, n] (this rank's rows for each rank's n experts) -> [EP, n] (each rank's rows for this rank's
    experts): a fixed-size all-to-all every rank joins, also when it sends nothing."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received
