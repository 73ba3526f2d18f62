"""Gradient clipping by the global norm over all model-parallel ranks."""
import math

import torch
import torch.distributed as dist

from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .layers import GroupedQKVStride
from .utils import full_numel, full_shape, get_device


def duplicate_ranges(param, rank, world_size):
    """[(lo, hi)] ranges of `param`'s flattened elements (this rank's piece) that another model-parallel rank holds
    and counts too, so this rank leaves them out of the global gradient norm: all of a replicated parameter on
    ranks other than 0; the replicated key/value rows of a fused q/k/v split as GroupedQKVStride on every holder
    but the first (GroupedQKVStride.duplicate_rows; the rows are contiguous, dim 0). Reads the attributes only
    (`model_parallel`, `partition_dim`, `partition_stride`) and the whole shape (a ZeRO-3 parameter's too)."""
    numel = full_numel(param)
    if not getattr(param, "model_parallel", False):
        return [(0, numel)] if rank != 0 else []
    stride = getattr(param, "partition_stride", 1)
    rows = stride.duplicate_rows(world_size, rank) if isinstance(stride, GroupedQKVStride) else None
    if rows is None:
        return []
    assert getattr(param, "partition_dim", 0) == 0, "a GroupedQKVStride splits rows (dim 0)"
    row = numel // full_shape(param)[0]
    return [(rows[0] * row, rows[1] * row)]


def _counted_pieces(param, rank, world_size):
    """The pieces of param.grad (flat views) this rank counts in the global norm."""
    excluded = duplicate_ranges(param, rank, world_size)
    if not excluded:
        return [param.grad]
    flat, pieces, start = param.grad.reshape(-1), [], 0
    for lo, hi in excluded:
        if lo > start:
            pieces.append(flat[start:lo])
        start = hi
    if start < flat.numel():
        pieces.append(flat[start:])
    return pieces


def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    """Like torch.nn.utils.clip_grad_norm_ on the whole (gathered) model: split parameters count once per
    shard, replicated ones (and replicated key/value heads: duplicate_ranges) once in total. Scales the gradients
    in place; returns the total norm (float)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = parameters[0].grad.device if parameters else get_device()   # NCCL needs a device tensor
    rank, world_size = get_model_parallel_rank(), get_model_parallel_world_size()
    counted = [piece for p in parameters for piece in _counted_pieces(p, rank, world_size)]
    if norm_type == math.inf:
        local = max([g.abs().max().float() for g in counted], default=torch.zeros((), device=device))
        total = local.reshape(1).clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=get_model_parallel_group())
        total_norm = float(total)
    else:
        local = sum([g.float().norm(norm_type) ** norm_type for g in counted], torch.zeros((), device=device))
        total = local.reshape(1).clone()
        dist.all_reduce(total, group=get_model_parallel_group())
        total_norm = float(total) ** (1.0 / norm_type)
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for p in parameters:
            p.grad.mul_(clip_coef)
    return total_norm
