"""Collectives the engine and activation checkpointing share."""
import torch.distributed as dist


def all_gather_into_tensor(output, tensor, group):
    """Gather every rank's `tensor` into the flat `output` (rank r's piece at [r n, (r+1) n)); `tensor` may be
    output's own piece (in place). all_gather_single where torch has it, all_gather_into_tensor before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
