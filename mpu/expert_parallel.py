"""The expert-parallel layout and the all-to-all that carries tokens to their experts and back.

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
expert-data-parallel group. The groups themselves (initialize_expert_parallel, the getters) live in
mpu/initialize.py beside the other process groups, built from expert_parallel_layout below: destroy_model_parallel
forgets them all, and this module imports nothing from mpu.

all_to_all(x, output_splits, input_splits, group) is its own pair: its backward is the all-to-all with the splits
swapped. Every rank calls it with its own (possibly zero) split sizes; empty pieces are normal.
"""
import torch
import torch.distributed as dist


def expert_parallel_layout(data_parallel_ranks, expert_model_parallel_size):
    """(expert-model-parallel groups, expert-data-parallel groups) of one data-parallel group's global ranks (in
    data-parallel rank order): consecutive blocks of EP, and the ranks at the same position of the blocks."""
    ep = expert_model_parallel_size
    blocks = [list(data_parallel_ranks[i:i + ep]) for i in range(0, len(data_parallel_ranks), ep)]
    return blocks, [[block[j] for block in blocks] for j in range(ep)]


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
