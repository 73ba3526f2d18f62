"""The NCCL-rules mode: every torch.distributed collective checks what NCCL would refuse, on gloo too.

    MEGATRON_NCCL_RULES=1 pytest tests      # tests/conftest.py sets it: the whole suite runs under the rules

The rules, enforced whatever the backend:
  1. device   a collective's tensors live on the run's device (mpu.get_device()): on a CUDA run a CPU tensor in
              an NCCL collective fails ("No backend type associated with device type cpu")
  2. offload  never in host offload memory (megatron.zero.offload records each such allocation): on gloo the host
              and the "device" are both the CPU, so this is the rule that catches an offload bug on a CPU machine
  3. bound    no collective before this process bound its device: mpu.set_device() ran (mpu.init_distributed runs
              it) and, on CUDA, the current device really is the rank's (torch.cuda.current_device()). NCCL groups
              and torch's object collectives use the current CUDA device, cuda:0 on every rank until it is set
              (duplicate-GPU errors, or a hang at the first object collective)

Rule 1 can only see a host tensor where the device is not the CPU. tests/zero/test_nccl_rules.py makes it so on a
CPU machine: mpu's device answers "meta" and the engine runs on torch's fake process group, so anything a
collective is handed from the host (a bucket allocated beside an offloaded partition, norm sums left where offloaded
gradients live, a client's model never moved) is refused by name.

`install()` wraps torch.distributed's collectives once per process: the module attributes every caller reaches
through `dist.<name>` (as breadcrumbs.install_collective_breadcrumbs does) and the ProcessGroup methods they end
in (`group.allreduce(...)`, reached directly by some clients and by torch's own object collectives);
`deepspeed.comm` (megatron/zero/as_deepspeed/comm.py) looks `dist.<name>` up at each call, so it is checked too.
megatron.spawn's workers and initialize_megatron call `install_if_requested()`. A broken rule raises NcclRuleError
naming the collective, the rule, the tensor and the caller.
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
# torch's ProcessGroup methods (what the functions above call, and what a client holding a group may call)
GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                 "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single", "broadcast", "reduce",
                 "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall",
                 "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "barrier", "gather",
                 "scatter")

_ORIGINALS = {}       # (owner, name) -> the unwrapped function, for uninstall()
checked = 0           # collectives checked in this process (a test can see the rules were on)


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
    """Wrap every collective in CHECKED and every ProcessGroup method in GROUP_METHODS (once: a second call changes
    nothing). Returns the names wrapped."""
    import torch.distributed as dist
    wrapped = []
    for owner, names in ((dist, CHECKED), (dist.ProcessGroup, GROUP_METHODS)):
        for name in names:
            # a class's own entry: pybind's method, which takes the group as its first argument
            function = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if function is None or getattr(function, "_nccl_rules", False):
                continue
            _ORIGINALS[(owner, name)] = function
            setattr(owner, name, _checking(name, function))
            wrapped.append(name)
    return wrapped


def uninstall():
    """Put back what install() wrapped (a test that turns the rules on in its own process turns them off)."""
    while _ORIGINALS:
        (owner, name), function = _ORIGINALS.popitem()
        setattr(owner, name, function)


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
    global checked
    checked += 1
    device = mpu.get_device()
    current = mpu.current_device(device)
    if current != device:
        raise NcclRuleError(_message(name, f"the current device {current}, not this rank's device {device} (the "
                                           f"device is not bound: mpu.set_device())"))
    if not mpu.device_is_set():
        raise NcclRuleError(_message(name, "the process's device is not bound yet (call mpu.init_distributed, or "
                                           "mpu.set_device() before torch.distributed starts)"))
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
