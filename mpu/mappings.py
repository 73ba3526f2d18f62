"""Autograd functions that move activations into and out of model-parallel regions.

They come in pairs whose forward of one is the backward of the other:
    copy_to_model_parallel_region      forward: identity        backward: all-reduce
    reduce_from_model_parallel_region  forward: all-reduce      backward: identity
    scatter_to_model_parallel_region   forward: keep my slice   backward: all-gather
    gather_from_model_parallel_region  forward: all-gather      backward: keep my slice
Slices are taken along the last dimension: model-parallel rank r of m keeps columns [r*n/m, (r+1)*n/m).
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
