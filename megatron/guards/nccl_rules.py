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

  4. p2p      point-to-point operations pair and run as NCCL's do: matched per peer in posting order (not by tag),
              each waiting for those posted before it; an order that hangs on NCCL (at a context-parallel ring of 2,
              a send then a receive on both ranks instead of one batch_isend_irecv) or a pair that differs in size,
              dtype or tag fails by name (megatron/guards/p2p_order.py replays every rank's posts from the store)

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
import threading

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
        if getattr(_inside, "call", False):   # torch's own calls inside a checked one (dist.send -> group.send)
            return function(*args, **kwargs)
        _check_p2p_order(name, args, kwargs)
        _inside.call = True
        try:
            return function(*args, **kwargs)
        finally:
            _inside.call = False
    call._nccl_rules = True
    return call


_inside = threading.local()     # .call: this thread is inside a checked call
_trackers = {}        # id(default store) -> (store, p2p_order.Tracker)


def _check_p2p_order(name, args, kwargs):
    """Rule 4: post this call's point-to-point unit to the model (p2p_order.Tracker), which raises on an order
    or a pairing NCCL would hang on or mismatch."""
    from . import p2p_order
    tracker = _p2p_tracker() if name in P2P_CALLS else None
    ops = _p2p_ops(name, args, kwargs) if tracker is not None else None
    if not ops:
        return
    try:
        tracker.post(ops, blocking=name in ("send", "recv") and not isinstance(args[0], _process_group()))
    except p2p_order.P2POrderError as error:
        raise NcclRuleError(_message(name, str(error))) from None


P2P_CALLS = ("send", "recv", "batch_isend_irecv")


def _process_group():
    import torch.distributed as dist
    return dist.ProcessGroup


def _p2p_tracker():
    """This process's p2p_order.Tracker, or None where there is nothing to model (no process group, one rank,
    torch's fake process group)."""
    import torch.distributed as dist
    from . import p2p_order
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    store = dist.distributed_c10d._get_default_store()
    if id(store) not in _trackers or _trackers[id(store)][0] is not store:
        _trackers[id(store)] = (store, p2p_order.Tracker(store, dist.get_rank()))
    return _trackers[id(store)][1]


def _p2p_ops(name, args, kwargs):
    """[(kind, global peer, numel, dtype, tag)] of a send, recv (module function or ProcessGroup method: a lone
    isend/irecv reaches the latter) or batch_isend_irecv; [] for a receive from any source (not modelled)."""
    import torch.distributed as dist
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        return [("send" if op.op is dist.isend else "recv", op.peer, op.tensor.numel(), str(op.tensor.dtype),
                 op.tag) for op in ops]
    if isinstance(args[0], dist.ProcessGroup):          # group.send(tensors, group rank, tag)
        group, tensors, peer, tag = args[0], args[1], args[2], args[3] if len(args) > 3 else kwargs.get("tag", 0)
        peer = dist.get_global_rank(group, peer) if group is not dist.group.WORLD else peer
        return [(name, peer, sum(t.numel() for t in tensors), str(tensors[0].dtype), tag)]
    names = ("tensor", "dst" if name == "send" else "src", "group", "tag", "group_dst" if name == "send" else
             "group_src")
    bound = dict(zip(names, args), **kwargs)
    peer, group = bound.get(names[1]), bound.get("group")
    if peer is None and bound.get(names[4]) is not None:
        peer = dist.get_global_rank(group or dist.group.WORLD, bound[names[4]])
    if peer is None:
        return []
    tensor = bound["tensor"]
    return [(name, peer, tensor.numel(), str(tensor.dtype), bound.get("tag", 0))]


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
