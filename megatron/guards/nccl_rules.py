"""The NCCL-rules mode: every torch.distributed collective checks what NCCL would refuse, on gloo too.

    MEGATRON_NCCL_RULES=1 pytest tests      # tests/conftest.py sets it: the whole suite runs under the rules

The rules, enforced whatever the backend:
  1. device   a collective's tensors live on the run's device (mpu.get_device()): on a CUDA run a CPU tensor in
              an NCCL collective fails ("No backend type associated with device type cpu")
  2. offload  never in host offload memory (megatron.zero.offload records each such allocation): on gloo the host
              and the "device" are both the CPU, so this is the rule that catches an offload bug on a CPU machine
  3. bound    no collective before this process bound its device (mpu.set_device(), run by mpu.init_distributed):
              NCCL groups and torch's object collectives use the current CUDA device, cuda:0 on every rank until
              it is set (duplicate-GPU errors, or a hang at the first object collective)

`install()` wraps torch.distributed's collectives once per process (the module attributes every caller reaches
through `dist.<name>`, as breadcrumbs.install_collective_breadcrumbs does); megatron.spawn's workers and
initialize_megatron call `install_if_requested()`. A broken rule raises NcclRuleError naming the collective, the
rule, the tensor and the caller.
"""
import functools
import os

ENV = "MEGATRON_NCCL_RULES"

# the collectives callers reach as `dist.<name>` (isend/irecv are left alone: P2POp tells them apart by identity;
# batch_isend_irecv checks its ops' tensors)
CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce", "reduce_scatter",
           "reduce_scatter_tensor", "broadcast", "barrier", "all_to_all", "all_to_all_single", "send", "recv",
           "batch_isend_irecv", "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
           "scatter_object_list")


class NcclRuleError(RuntimeError):
    """A collective NCCL would refuse (or run on the wrong GPU)."""


def requested():
    return os.environ.get(ENV) == "1"


def install_if_requested():
    """install() when MEGATRON_NCCL_RULES=1; returns whether the rules are on."""
    if requested():
        install()
    return requested()


def install():
    """Wrap every collective in CHECKED (once: a second call changes nothing). Returns the names wrapped."""
    import torch.distributed as dist
    wrapped = []
    for name in CHECKED:
        function = getattr(dist, name, None)
        if function is None or getattr(function, "_nccl_rules", False):
            continue
        setattr(dist, name, _checking(name, function))
        wrapped.append(name)
    return wrapped


def _checking(name, function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        check(name, list(args) + list(kwargs.values()))
        return function(*args, **kwargs)
    call._nccl_rules = True
    return call


def tensors_in(values):
    """The tensors among a collective's arguments: tensors, lists of tensors, P2POps' tensors."""
    import torch
    found = []
    for value in values:
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(tensors_in(value))
        elif hasattr(value, "op") and torch.is_tensor(getattr(value, "tensor", None)):     # a P2POp
            found.append(value.tensor)
    return found


def check(name, values):
    """Raise NcclRuleError when the collective `name` on these arguments breaks a rule."""
    import mpu
    from megatron.zero import offload
    if not mpu.device_is_set():
        raise NcclRuleError(_message(name, "the process's device is not bound yet (call mpu.init_distributed, or "
                                           "mpu.set_device() before torch.distributed starts)"))
    device = mpu.get_device()
    for tensor in tensors_in(values):
        if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
            raise NcclRuleError(_message(name, f"a tensor {list(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                                               f"not on this rank's device {device}"))
        if offload.is_host_offload(tensor):
            raise NcclRuleError(_message(name, f"a tensor {list(tensor.shape)} {tensor.dtype} in host offload "
                                               f"memory (NCCL takes device tensors only: stage it on {device})"))


def _message(name, what):
    from .breadcrumbs import _caller
    return f"NCCL rule broken: {name} called from {_caller((os.path.abspath(__file__),))} with {what}"
