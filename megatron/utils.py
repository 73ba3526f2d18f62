"""Training-script utilities (what the seed tutorial puts here): logging on rank 0, loss reduction across the
data-parallel group, and unwrapping a model from its DDP / ZeRO-engine wrappers. Checkpoints (save, load, RNG
states, any-topology reading) are megatron.checkpoint's.
"""
import torch
import torch.distributed as dist

import mpu
from megatron.guards import breadcrumbs


def print_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def reduce_losses(losses):
    """Average each loss over the data-parallel group; returns a tensor of the averages (detached)."""
    reduced = torch.stack([loss.detach().float() for loss in losses])
    breadcrumbs.all_reduce(reduced, "reduce_losses", group=mpu.get_data_parallel_group())
    return reduced / mpu.get_data_parallel_world_size()


def unwrap_model(model):
    """The bare module inside DDP wrappers or the ZeRO engine."""
    while hasattr(model, "module"):
        model = model.module
    return model
