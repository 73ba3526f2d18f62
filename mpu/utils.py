"""Small helpers shared by the mpu modules: the device, divisibility checks, tensor splitting."""
import os

import torch


def get_device():
    """The one place the compute device is chosen: this process's GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def get_backend():
    """nccl on CUDA, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


_DEVICE_SET = False


def set_device():
    """Bind this process to its device (`torch.cuda.set_device(LOCAL_RANK)` on CUDA) and return it. Must run before
    the first NCCL group exists: NCCL and torch's object collectives use the *current* CUDA device, which is cuda:0
    on every rank until set (duplicate-GPU errors, or a hang at the first object collective)."""
    global _DEVICE_SET
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _DEVICE_SET = True
    return device


def current_device(device=None):
    """The device this process's work goes to now: on CUDA `torch.cuda.current_device()` (what NCCL's groups and
    torch's object collectives use), whatever get_device() says; a device with no current one to bind (the CPU,
    "meta") is `device` (default get_device()) itself."""
    device = get_device() if device is None else device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_is_set():
    """Whether this process is bound to its device: set_device() ran and the current device (current_device()) is
    still this rank's, not only a record that it was once set (the NCCL-rules check refuses collectives otherwise)."""
    return _DEVICE_SET and current_device() == get_device()


def init_distributed(backend=None, **kwargs):
    """The one way this codebase starts torch.distributed: set_device(), then init_process_group with `backend`
    (default: get_backend()) and `kwargs` (init_method, store, rank, world_size, timeout). Returns the backend."""
    import torch.distributed as dist
    set_device()
    backend = backend or get_backend()
    dist.init_process_group(backend=backend, **kwargs)
    return backend


def full_numel(param):
    """Elements of the whole parameter, also while ZeRO-3 holds only a partition of it (`ds_numel`, DeepSpeed's
    attribute name): what parameter counts, memory estimates and checkpoint shapes use."""
    return getattr(param, "ds_numel", None) or param.numel()


def full_shape(param):
    """The whole parameter's shape, also while ZeRO-3 holds only a partition of it (`ds_shape`)."""
    shape = getattr(param, "ds_shape", None)
    return param.shape if shape is None else shape     # not `or`: a scalar's ds_shape, torch.Size([]), is falsy


def ensure_divisibility(numerator, denominator, what="value"):
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")


def divide(numerator, denominator, what="value"):
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def split_tensor_along_last_dim(tensor, num_partitions, contiguous_split_chunks=False):
    """Split `tensor` into `num_partitions` equal chunks along its last dimension."""
    last_dim_size = divide(tensor.size(-1), num_partitions, "last dimension")
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """The vocabulary range [first, last) owned by a model-parallel rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition = divide(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank)
