"""ZeRO stage 3's gathered storage: a `_Buffer` holds some parameters' runs of their groups' flat order, laid out
one after another; it is gathered (one broadcast per owner of a piece, asynchronous), waited for (wait_for_gather:
timed on gloo only), and released (the storage dropped, the parameters empty again), publishing `ds_status`.
A *resident* buffer (every run in a group partitioned over one rank and not offloaded: `resident_group`) has no
storage of its own: its parameters are views of their groups' partitions (`attach`), always AVAILABLE.

stage3.py decides which buffers a unit needs and when (its hooks); both names here are importable from
megatron.zero.stage3 too, and it is the same class there (tests patch stage3._Buffer.start_gather).
"""
import torch
import torch.distributed as dist

from mpu.utils import full_numel, full_shape

from .param_status import ZeroParamStatus, set_status
from .partition import context_of


def resident_group(group, ctx):
    """Whether `group`'s partition is the whole group on this rank's compute device: its data-parallel context
    (an expert group's own: the expert-data-parallel group) has one rank, and offload_param did not move it to
    host memory. Its parameters can then be views of the partition: there is nothing to gather."""
    return context_of(group, ctx).data_parallel_size == 1 and not group.offloaded


class _Buffer:
    """The gathered storage of some parameters: runs of group flat ranges laid out one after another."""

    def __init__(self, name, params, groups, ctx, device, persistent=False, resident=False):
        """`resident`: may be resident (Stage3Parameters passes its setting); it is when every run's group is
        resident_group's."""
        self.name, self.params, self.ctx, self.persistent = name, params, ctx, persistent
        self.dtype = groups[0].dtype if groups else torch.float32
        where = {id(p): (gi, group.offsets[i]) for gi, group in enumerate(groups) for i, p in enumerate(group.params)}
        spans = sorted(where[id(p)] for p in params)          # (group index, (flat start, flat end))
        self.runs = []                                          # (group, flat lo, flat hi, buffer offset)
        self.view_of = {}                                       # id(param) -> buffer offset
        self.flat_of = {id(p): (groups[where[id(p)][0]], where[id(p)][1][0]) for p in params}   # (group, flat start)
        offset = 0
        for gi, (lo, hi) in spans:
            if self.runs and self.runs[-1][0] is groups[gi] and self.runs[-1][2] == lo:
                group, run_lo, _, run_offset = self.runs[-1]
                self.runs[-1] = (group, run_lo, hi, run_offset)
            else:
                self.runs.append((groups[gi], lo, hi, offset))
            offset += hi - lo
        for p in params:
            gi, (lo, _) = where[id(p)]
            run = next(r for r in self.runs if r[0] is groups[gi] and r[1] <= lo < r[2])
            self.view_of[id(p)] = run[3] + lo - run[1]
        self.numel = offset
        self.device = device
        self.placeholder = torch.empty(0, dtype=self.dtype, device=device)
        self.storage = self.placeholder  # a fresh tensor per gather (see release)
        self.nbytes = self.numel * self.placeholder.element_size()
        self.state = "released"          # released | in_flight | ready
        self.handles = []
        self.holders = 0                 # units using it in a forward now (GatheredParameters counts too)
        self.pending_grads = set()       # ids of its trainable parameters whose gradient has not arrived
        self.has_frozen = any(not p.requires_grad for p in params)
        self.inputs_reached = False      # has_frozen: a unit using it has finished its backward (to its inputs)
        self.stale = True                # persistent buffer: refresh at the next use
        self.host_waits = ctx.data_parallel_size > 1 and dist.get_backend(ctx.data_parallel_group) == "gloo"
        # resident (and allowed): views of the partitions for good; Stage3Parameters never gathers nor releases it
        self.resident = resident and bool(self.runs) and all(resident_group(run[0], ctx) for run in self.runs)

    def attach(self):
        """Resident: point every parameter at its range of its group's partition (again: after the partitions
        were swapped, or a client's copy taken in GatheredParameters is dropped)."""
        for p in self.params:
            group, lo = self.flat_of[id(p)]
            start = lo - group.own_range[0]
            p.data = group.partition[start:start + full_numel(p)].view(full_shape(p))
        self.state, self.stale = "ready", False
        self.publish_status()

    def start_gather(self):
        """Allocate and launch the broadcasts of every owner's piece (asynchronous)."""
        self.storage = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for flat_group, lo, hi, offset in self.runs:
            data_parallel = context_of(flat_group, self.ctx)     # expert parameters: their own group
            for owner, a, b in flat_group.owners(lo, hi):
                piece = self.storage[offset + a - lo:offset + b - lo]
                if owner == data_parallel.data_parallel_rank:
                    own_start = flat_group.own_range[0]
                    source = flat_group.partition[a - own_start:b - own_start]
                    # a pinned (offloaded) partition: an asynchronous host-to-device copy, ordered before the
                    # broadcast on the same stream; the partition is written again only by the step, after backward
                    piece.copy_(source, non_blocking=source.is_pinned())
                if data_parallel.data_parallel_size > 1:
                    self.handles.append(dist.broadcast(piece, group_src=owner, group=data_parallel.data_parallel_group,
                                                       async_op=True))
        self.state = "in_flight"
        self.publish_status()

    def finish_gather(self, timeout, unit_name):
        for handle in self.handles:
            if not wait_for_gather(handle, timeout, self.host_waits):
                raise RuntimeError(f"ZeRO-3: waiting for the parameters of {unit_name!r} did not complete")
        self.handles = []
        for p in self.params:
            offset = self.view_of[id(p)]
            p.data = self.storage[offset:offset + full_numel(p)].view(full_shape(p))
        self.state, self.stale = "ready", False
        self.publish_status()

    def release(self):
        for handle in self.handles:
            handle.wait()
        self.handles = []
        for p in self.params:
            p.data = self.placeholder
        # Drop the reference instead of freeing the storage in place (DeepSpeed swaps param.data the same way): the
        # memory returns to the allocator, unless a tensor taken while gathered still views it (`p.data.cpu()`
        # inside GatheredParameters is such a view on the CPU), which stays valid, as a user expects.
        self.storage = self.placeholder
        self.state = "released"
        self.publish_status()

    def publish_status(self):
        """`param.ds_status` for DeepSpeed clients (param_status.py): AVAILABLE only when ready and up to date."""
        status = ZeroParamStatus.AVAILABLE if self.state == "ready" and not self.stale else \
            ZeroParamStatus.INFLIGHT if self.state == "in_flight" else ZeroParamStatus.NOT_AVAILABLE
        set_status(self.params, status)


def wait_for_gather(handle, timeout, host_waits):
    """Complete a gather's broadcast. `host_waits` (gloo: the host does the work anyway): wait at most `timeout`, so
    a rank whose peers never join raises naming the unit. Otherwise (NCCL) a plain wait(): the compute stream waits
    for the communication stream and the host runs on (a wait with a timeout would block the host at every unit,
    and no prefetch could overlap); a peer that never joins is reported by the process group's timeout and the
    breadcrumbs' slow-step watchdog. Returns whether the wait completed."""
    if host_waits:
        return handle.wait(timeout=timeout)
    handle.wait()
    return True
