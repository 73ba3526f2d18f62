"""Autograd functions that move activations into and out of model-parallel regions.

They come in pairs whose forward of one is the backward of the other:
    copy_to_model_parallel_region      forward: identity        backward: all-reduce
    reduce_from_model_parallel_region  forward: all-reduce      backward: identity
    scatter_to_model_parallel_region   forward: keep my slice   backward: all-gather
    gather_from_model_parallel_region  forward: all-gather      backward: keep my slice
Slices are taken along the last dimension: model-parallel rank r of m keeps columns [r*n/m, (r+1)*n/m).
The sequence-parallel pairs (scatter/gather/reduce-scatter along the sequence) are below, with their table.
"""
import torch
import torch.distributed as dist

from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .utils import split_tensor_along_last_dim


def _reduce(input_):
    """All-reduce over the model-parallel group (in place on a fresh tensor)."""
    if get_model_parallel_world_size() == 1:
        return input_
    output = input_.clone()
    dist.all_reduce(output, group=get_model_parallel_group())
    return output


def _split(input_):
    """This rank's slice of the last dimension."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    return split_tensor_along_last_dim(input_, world_size)[get_model_parallel_rank()].contiguous()


def _gather(input_):
    """Concatenate every rank's slice along the last dimension."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    pieces = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(pieces, input_, group=get_model_parallel_group())
    return torch.cat(pieces, dim=-1)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split(grad_output)


# At model-parallel size 1 each region is the identity both ways: return the input itself rather than go through
# an autograd Function (~9 us each, 18 per generated token of a 4-layer model: what bench_generate measured).
def copy_to_model_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_model_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _ScatterToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _GatherFromModelParallelRegion.apply(input_)


# Sequence parallelism (Megatron-LM's tensor_parallel mappings): the LayerNorm, dropout and residual regions hold
# rank r's slice of the sequence, positions [r*s/m, (r+1)*s/m) of the activations [b, s, h] (dimension 1); the
# column/row-parallel linears between them work on the whole sequence. The pairs:
#     scatter_to_sequence_parallel_region        forward: keep my sequence slice   backward: all-gather
#     gather_from_sequence_parallel_region       forward: all-gather               backward: reduce-scatter
#                                                  (tensor_parallel_output_grad=False: keep my slice)
#     reduce_scatter_to_sequence_parallel_region forward: reduce-scatter         backward: all-gather
# They replace copy (identity/all-reduce) before a column-parallel linear and reduce (all-reduce/identity) after a
# row-parallel one: at m = 2, s = 4, rank 0 holds positions 0-1 and rank 1 positions 2-3 of every row; the gather
# gives both ranks positions 0-3, the row-parallel linear's partial sums [b, 4, h] are summed and cut back into
# the two slices.
SEQUENCE_DIM = 1


def _split_sequence(input_):
    """This rank's slice of the sequence dimension."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    length = input_.size(SEQUENCE_DIM)
    if length % world_size:
        raise ValueError(f"sequence parallelism: the sequence length {length} is not divisible by the "
                         f"model-parallel size {world_size}")
    return input_.chunk(world_size, dim=SEQUENCE_DIM)[get_model_parallel_rank()].contiguous()


def gather_sequence(input_):
    """Concatenate every rank's sequence slice (the collective alone, no autograd: also used by layers.py's
    sequence-parallel linear). One all_gather_into_tensor into [m, b, s/m, ...] (each rank's slice lands
    contiguous), then one copy into [b, s, ...]: not a list collective plus a concatenation on the middle dimension."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    gathered = torch.empty((world_size * input_.size(0),) + tuple(input_.shape[1:]), dtype=input_.dtype,
                           device=input_.device)          # gloo wants the ranks along the first dimension
    dist.all_gather_into_tensor(gathered, input_, group=get_model_parallel_group())
    shape = list(input_.shape)
    shape[SEQUENCE_DIM] *= world_size
    return gathered.view(world_size, *input_.shape).movedim(0, SEQUENCE_DIM).reshape(shape)


def reduce_scatter_sequence(input_):
    """Sum over the group, then keep this rank's sequence slice: one copy of [b, s, ...] into [m, b, s/m, ...] (rank
    r's slice contiguous at r), then one reduce_scatter_tensor."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    length = input_.size(SEQUENCE_DIM)
    if length % world_size:
        raise ValueError(f"sequence parallelism: the sequence length {length} is not divisible by the "
                         f"model-parallel size {world_size}")
    shape = list(input_.shape)
    shape[SEQUENCE_DIM:SEQUENCE_DIM + 1] = [world_size, length // world_size]
    pieces = input_.reshape(shape).movedim(SEQUENCE_DIM, 0).contiguous()
    output = torch.empty_like(pieces[0])
    dist.reduce_scatter_tensor(output, pieces.flatten(0, 1), group=get_model_parallel_group())
    return output


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_sequence(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_sequence(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_sequence(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # Into a tensor-parallel linear each rank's gradient is a partial sum (its columns' share): sum and cut.
        # Into a computation replicated on every rank the gradient is already whole: cut only.
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_sequence(grad_output), None
        return _split_sequence(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return reduce_scatter_sequence(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_sequence(grad_output)


def scatter_to_sequence_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True):
    """tensor_parallel_output_grad: the gathered tensor feeds a tensor-parallel computation (a column-parallel
    linear, the vocabulary-parallel LM head), so backward reduce-scatters; False: a replicated one, backward
    keeps this rank's slice of the (identical) gradient."""
    if get_model_parallel_world_size() == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_):
    return input_ if get_model_parallel_world_size() == 1 else _ReduceScatterToSequenceParallelRegion.apply(input_)
