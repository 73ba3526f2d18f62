"""Host memory the engine offloads to (offload_optimizer, offload_param, cpu_checkpointing), allocated here only.

    master = offload.host_copy(partition, torch.float32, pin_memory=True)   # recorded as host offload memory
    grads = offload.host_zeros(n, torch.float32)
    offload.is_host_offload(tensor)       # True for these and any view of them

Why one place: NCCL refuses host tensors, and on a CPU-only machine (gloo) a host tensor and a "device" tensor are
the same kind of thing, so a collective handed offload memory would pass every CPU test and fail at the first
step on GPUs. Every offload allocation is recorded by its storage's address range, and the tests' NCCL-rules mode
(megatron.guards.nccl_rules) refuses a collective on any recorded storage on gloo too. A record lives as long as
the tensor object returned here (weakref); views keep the memory alive past it, so keep the returned tensor.
"""
import weakref

import torch

HOST = torch.device("cpu")
_RANGES = {}          # key -> (first byte address, end address) of a recorded storage
_next_key = 0


def record(tensor):
    """Record `tensor`'s storage as host offload memory (until `tensor` is freed); returns `tensor`."""
    global _next_key
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    if storage.nbytes() == 0 or start == 0:
        return tensor
    key, _next_key = _next_key, _next_key + 1
    _RANGES[key] = (start, start + storage.nbytes())
    weakref.finalize(tensor, _RANGES.pop, key, None)
    return tensor


def _pinned(tensor, pin_memory):
    return tensor.pin_memory() if pin_memory and torch.cuda.is_available() else tensor


def host_zeros(numel, dtype, pin_memory=False):
    """`numel` zeros in host memory (pinned when asked and CUDA is present), recorded."""
    return record(_pinned(torch.zeros(numel, dtype=dtype, device=HOST), pin_memory))


def host_copy(tensor, dtype=None, pin_memory=False):
    """A copy of `tensor` in host memory (in `dtype`; always a copy, even of a host tensor), recorded."""
    copy = tensor.detach().to(HOST, dtype or tensor.dtype, copy=True)
    return record(_pinned(copy, pin_memory))


def to_device(tensor, device):
    """`tensor` on `device` for a collective: a copy when it is host offload memory, even where `device` is the
    host itself (tensor.to(cpu) would return the offload memory on a CPU run, and the collective would take it)."""
    return tensor.to(device, copy=is_host_offload(tensor))


def is_host_offload(tensor):
    """Whether `tensor` (or the storage it views) was allocated here."""
    if tensor.device.type != "cpu" or not _RANGES:
        return False
    address = tensor.untyped_storage().data_ptr()
    return any(start <= address < end for start, end in _RANGES.values())
