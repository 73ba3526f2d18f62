"""`deepspeed.comm`: torch.distributed under DeepSpeed's names, started the way this codebase starts it.

The collectives are torch.distributed's own functions (DeepSpeed's wrappers take the same arguments), looked up on
torch.distributed at each call: what the NCCL-rules mode (megatron/guards/nccl_rules.py) or the breadcrumbs wrap
there is what a client's `deepspeed.comm.all_reduce` reaches, whenever either was installed. `init_distributed` is
DeepSpeed's entry point, through mpu.init_distributed so the device is set before the first process group (NCCL
otherwise puts every rank on cuda:0).
"""
import datetime
import os

import torch.distributed as dist
from torch.distributed import (ReduceOp, destroy_process_group, get_global_rank, get_rank,  # noqa: F401
                               get_world_size, irecv, isend, is_initialized, new_group)

import mpu

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "broadcast",
               "gather", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "send")


def _forward(name):
    def collective(*args, **kwargs):
        return getattr(dist, name)(*args, **kwargs)
    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = f"torch.distributed.{name}, as it is at the call (checked under the NCCL-rules mode)."
    return collective


all_gather, all_gather_into_tensor, all_reduce, all_to_all_single, barrier, broadcast, gather, recv, reduce, \
    reduce_scatter, reduce_scatter_tensor, scatter, send = map(_forward, COLLECTIVES)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=datetime.timedelta(minutes=30), init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """DeepSpeed's signature. A no-op when torch.distributed is up. From torchrun's environment (RANK, ...) or
    `init_method`; a process started without either runs alone (rank 0 of 1, an in-process store: no port to
    collide on) where DeepSpeed would try MPI discovery. `auto_mpi_discovery`, `distributed_port`, `verbose`,
    `config` have no effect here."""
    if dist.is_initialized() or dist_init_required is False:
        return
    options = {"timeout": timeout}
    if rank >= 0 and world_size > 0:
        options.update(rank=rank, world_size=world_size)
    if init_method is not None or "RANK" in os.environ:
        options["init_method"] = init_method
    else:
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    mpu.init_distributed(dist_backend, **options)


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))
