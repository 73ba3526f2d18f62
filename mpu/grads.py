"""Gradient clipping by the global norm over all model-parallel ranks."""
import math

import torch
import torch.distributed as dist

from .initialize import get_model_parallel_group, get_model_parallel_rank
from .utils import get_device


def is_model_parallel_duplicate(param):
    """True for a parameter replicated on every model-parallel rank, counted only by rank 0."""
    return not getattr(param, "model_parallel", False) and get_model_parallel_rank() != 0


def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    """Like torch.nn.utils.clip_grad_norm_ on the whole (gathered) model: split parameters count once per
    shard, replicated ones once in total. Scales the gradients in place; returns the total norm (float)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = parameters[0].grad.device if parameters else get_device()   # NCCL needs a device tensor
    counted = [p.grad for p in parameters if not is_model_parallel_duplicate(p)]
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
