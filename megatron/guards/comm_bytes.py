"""Bytes each rank sends, counted by wrapping torch.distributed's collectives for the length of a `with` block.

    with CommCounter() as counter:
        loss = engine(x, y); engine.backward(loss); engine.step()
    counter.total_bytes()              # bytes this rank sent in the block (cost model below)
    counter.bytes_by_op                # {"reduce": ..., "all_gather_into_tensor": ...}
    counter.received_by_op             # {"batch_isend_irecv": ...}: the receives of point-to-point batches

Cost model: bytes one rank sends for a collective over a group of n ranks on a payload of B bytes, the volume of
the bandwidth-optimal ring (or pipelined chain) algorithms. The factors are NCCL's "bus bandwidth" factors
(nccl-tests, doc/PERFORMANCE.md: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n), where B is the
full buffer (all-gather: the gathered output; reduce-scatter: the input before scattering). For reduce and
broadcast NCCL's factor is 1 (its busiest link carries B); summed over the group a chain sends (n-1) B, and we
report that average per rank, (n-1)/n B, so that reducing every range of a buffer to its owner costs exactly one
reduce-scatter of it (what ZeRO stages 1/2 do, megatron/zero/bucketing.py).

    all_reduce              2 (n-1)/n B     B = tensor
    reduce_scatter(_tensor)   (n-1)/n B     B = input (the list's sum, or the input tensor)
    all_gather(_into_tensor)  (n-1)/n B     B = output (n x input)
    reduce, broadcast         (n-1)/n B     averaged over the group's ranks
    send, batch_isend_irecv         B       the sends' tensors (receives count 0)

Only the Python entry points of `torch.distributed` are wrapped (the module attributes, restored on exit: the one
place torch lets us observe every collective our code and torch's DDP comm hooks issue). Collectives torch issues
from C++ (DDP's built-in all-reduce without a comm hook, `*_object` helpers internally) are not seen; give torch
DDP the default all-reduce hook (`count_ddp_allreduce(ddp)`) to count its gradient traffic. `isend` itself is left
unwrapped (batch_isend_irecv tells sends from receives by `op.op is isend`), so a lone isend is not counted.
"""
import inspect
from collections import defaultdict

import torch
import torch.distributed as dist

# op -> (factor as a function of n, which bound argument holds the payload)
_COST = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, "tensor"),
    "reduce": (lambda n: (n - 1) / n, "tensor"),
    "broadcast": (lambda n: (n - 1) / n, "tensor"),
    "reduce_scatter": (lambda n: (n - 1) / n, "input_list"),
    "reduce_scatter_tensor": (lambda n: (n - 1) / n, "input"),
    "all_gather": (lambda n: (n - 1) / n, "tensor_list"),
    "all_gather_into_tensor": (lambda n: (n - 1) / n, "output_tensor"),
    "all_gather_single": (lambda n: (n - 1) / n, "output_tensor"),
    "send": (lambda n: 1.0, "tensor"),
    "batch_isend_irecv": (lambda n: 1.0, "p2p_op_list"),
}


def payload_bytes(value, direction=None):
    """Bytes of a tensor, a list of tensors, or the sends of a list of P2POps (receives carry nothing out; with
    direction=dist.irecv, the receives' bytes instead)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if value and isinstance(value[0], dist.P2POp):
        return sum(payload_bytes(op.tensor) for op in value if op.op is (direction or dist.isend))
    return sum(t.numel() * t.element_size() for t in value)


def collective_bytes(op, nbytes, group_size):
    """Bytes one rank sends for `op` on a payload of `nbytes` over `group_size` ranks (the table above)."""
    factor, _ = _COST[op]
    return factor(group_size) * nbytes if group_size > 1 else 0.0


class CommCounter:
    """Counts this rank's sent bytes, per op, for the collectives called inside the `with` block."""

    def __init__(self):
        self.bytes_by_op = defaultdict(float)
        self.received_by_op = defaultdict(float)     # point-to-point batches only (collectives are symmetric)
        self.calls_by_op = defaultdict(int)
        self._originals = {}

    def total_bytes(self):
        return sum(self.bytes_by_op.values())

    def __enter__(self):
        for op in _COST:
            original = getattr(dist, op, None)
            if original is not None:
                self._originals[op] = original
                setattr(dist, op, self._wrap(op, original))
        return self

    def __exit__(self, *exc):
        for op, original in self._originals.items():
            setattr(dist, op, original)
        self._originals.clear()
        return False

    def _wrap(self, op, original):
        signature = inspect.signature(original)
        _, payload_argument = _COST[op]

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.bytes_by_op[op] += collective_bytes(op, payload_bytes(bound.arguments[payload_argument]), size)
            if op == "batch_isend_irecv":
                self.received_by_op[op] += payload_bytes(bound.arguments[payload_argument], dist.irecv)
            self.calls_by_op[op] += 1
            return original(*args, **kwargs)
        return counted


def count_ddp_allreduce(ddp_model):
    """Route torch DDP's gradient all-reduce through Python (its default hook: divide by n, all_reduce), so a
    CommCounter sees it. The arithmetic is the same as DDP's built-in reducer."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp_model.register_comm_hook(state=None, hook=allreduce_hook)
    return ddp_model
