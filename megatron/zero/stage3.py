"""ZeRO stage 3: the 16-bit parameters partitioned too, gathered per unit just before use and released after.

Partitioning is the one of stages 1 and 2 (partition.py): each data-parallel rank owns one contiguous range of
each optimizer group's flat order, so the gradient buckets, the grad norm and the checkpoint layout are theirs
unchanged. A rank holds only that range (`PartitionedGroup.partition`, in host memory with offload_param).

Units: every element of an nn.ModuleList (a transformer layer, with its whole subtree) and every other module
that owns parameters directly (the embeddings, the final layer norm). A module that uses another module's
parameter in its forward declares it with `register_external_parameter` (the LM head and the tied word
embedding). A unit's own parameters live in one buffer whose storage is allocated when the unit is gathered and
dropped when it is released (a tensor a user took from it meanwhile stays valid); the parameters are views of it
while gathered and empty tensors (`ds_shape` / `ds_numel` keep the real shape) while released (`ds_status` says
which, for DeepSpeed clients: param_status.py). Parameters of at most
`stage3_param_persistence_threshold` elements share one buffer that is never released (refreshed after each
optimizer step).

    forward:  pre-hook: gather the unit (wait for its prefetch), prefetch the next units in the recorded
              forward order up to stage3_prefetch_bucket_size elements; post-hook: release, and hang a
              pre-backward function on the outputs. The units whose forwards end last (the first the backward
              needs: the LM head's tied embedding, the last layers) are not released but stay gathered into the
              backward, as many as fit in stage3_max_reuse_distance elements: no second gather for them
    backward: pre-backward: gather again (prefetch the units before it); a buffer is released when the gradients
              of all its parameters have arrived (their bucket hooks have run); the rest at the end of backward.
              A buffer holding frozen parameters (requires_grad False, e.g. LoRA's base weights: no gradient to
              wait for) is released once, besides, the backward of a unit using it has reached the unit's inputs
              (an identity on them, hung in the forward pre-hook), after which its weights are not needed

Gathering one contiguous run [lo, hi) of a group's flat order is one broadcast from each rank owning part of
it, into the buffer's slice. Every rank must run the same forwards: a rank that runs a forward alone waits for
gathers nobody else joins; it raises (naming the unit) after `gather_timeout`, instead of hanging.
"""
import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from mpu.utils import full_numel, full_shape

from . import offload
from .param_status import ZeroParamStatus, assign_id, set_status
from .partition import context_for, context_of, FlatLayout

DEFAULT_GATHER_TIMEOUT = datetime.timedelta(minutes=5)


class PartitionedGroup(FlatLayout):
    """One optimizer group at stage 3: only this rank's partition of the flat buffer exists, on `device`.

    `full_value(param)` returns the whole parameter (flat or shaped); it is called once per parameter, in group
    order, on every rank (it may be a collective), so at most one full parameter exists at a time here.
    """

    def __init__(self, params, num_partitions, rank, full_value, dtype, device, offloaded=False, pin_memory=False):
        """`offloaded` (offload_param): the partition is host offload memory (pinned with `pin_memory` on CUDA)."""
        super().__init__(params, num_partitions, rank)
        self.offloaded = offloaded
        self.partition = offload.host_zeros(self.partition_size, dtype, pin_memory) if offloaded else \
            torch.zeros(self.partition_size, dtype=dtype, device=device)
        start, end = self.own_range
        with torch.no_grad():
            for index, param in enumerate(self.params):
                value = full_value(param).reshape(-1)
                p_start, p_end = self.offsets[index]
                lo, hi = max(p_start, start), min(p_end, end)
                if lo < hi:
                    self.partition[lo - start:hi - start].copy_(value[lo - p_start:hi - p_start])

    @property
    def dtype(self):
        return self.partition.dtype

    @property
    def device(self):
        return self.partition.device

    def own_partition(self):
        return self.partition

    def parameter_bytes(self):
        return self.partition.numel() * self.partition.element_size()


def partition_parameters(module, param_groups, ctx, zero_config, dtype, device):
    """One PartitionedGroup per optimizer param group, in `dtype` (None: the parameters' own), then one more for
    the frozen parameters (requires_grad False: in no optimizer group, e.g. LoRA's base weights) when there are
    any: partitioned and gathered like the others, without optimizer state. Without an optimizer (no param
    groups: an inference engine) every parameter is in that stateless group. A parameter built whole is first
    broadcast from data-parallel rank 0 (as the other stages do); one built under zero.Init is gathered from its
    pieces. One parameter is whole at a time. `device`: the engine's compute device (where the partitions live
    without offload_param)."""
    from .zero_init import gather_initial

    def full_value(param, data_parallel):
        if hasattr(param, "ds_tensor"):
            if data_parallel is not ctx:
                raise ValueError("an expert parameter built under zero.Init: under expert parallelism build the model "
                                 "without zero.Init (zero.Init partitions over the data-parallel group, the experts "
                                 "belong to the expert-data-parallel one)")
            value = gather_initial(param, device)
            del param.ds_tensor
        else:
            value = param.data
            if data_parallel.data_parallel_size > 1:
                dist.broadcast(value, group_src=0, group=data_parallel.data_parallel_group)
            param.ds_shape, param.ds_numel = value.shape, value.numel()
        return value if dtype is None else value.to(dtype)

    in_groups = {id(p) for group in param_groups for p in group["params"]}
    stateless = [p for p in module.parameters()
                 if id(p) not in in_groups and (not p.requires_grad or not param_groups)]
    groups = []
    for params in [group["params"] for group in param_groups] + ([stateless] if stateless else []):
        group_dtype = dtype or (params[0].dtype if params else torch.float32)
        for param in params:
            assign_id(param)
        context = context_for(params, ctx)            # expert parameters: the expert-data-parallel group
        data_parallel = context or ctx
        groups.append(PartitionedGroup(params, data_parallel.data_parallel_size, data_parallel.data_parallel_rank,
                                       lambda param, data_parallel=data_parallel: full_value(param, data_parallel),
                                       group_dtype, device, zero_config.offload_param.enabled,
                                       zero_config.offload_param.pin_memory))   # pinned: faster copies to the device
        groups[-1].context = context
    return groups


class Unit:
    def __init__(self, name, module, params, external):
        self.name, self.module = name, module
        self.params, self.external = params, external
        self.buffers = []          # the _Buffers this unit needs gathered (own, external owners', persistent)


class _Buffer:
    """The gathered storage of some parameters: runs of group flat ranges laid out one after another."""

    def __init__(self, name, params, groups, ctx, device, persistent=False):
        self.name, self.params, self.ctx, self.persistent = name, params, ctx, persistent
        self.dtype = groups[0].dtype if groups else torch.float32
        where = {id(p): (gi, group.offsets[i]) for gi, group in enumerate(groups) for i, p in enumerate(group.params)}
        spans = sorted(where[id(p)] for p in params)          # (group index, (flat start, flat end))
        self.runs = []                                          # (group, flat lo, flat hi, buffer offset)
        self.view_of = {}                                       # id(param) -> buffer offset
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

    def start_gather(self):
        """Allocate and launch the broadcasts of every owner's piece (asynchronous)."""
        self.storage = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for flat_group, lo, hi, offset in self.runs:
            data_parallel = context_of(flat_group, self.ctx)     # expert parameters: their own group
            for owner, a, b in flat_group.owners(lo, hi):
                piece = self.storage[offset + a - lo:offset + b - lo]
                if owner == data_parallel.data_parallel_rank:
                    own_start = flat_group.own_range[0]
                    piece.copy_(flat_group.partition[a - own_start:b - own_start])
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


class _CallInBackward(torch.autograd.Function):
    """Identity on tensors whose backward first calls `on_backward()`: hung on a unit's outputs it gathers the
    unit before the unit's own backward runs; on a unit's inputs it runs once the unit's backward has produced
    their gradients."""

    @staticmethod
    def forward(ctx, on_backward, *tensors):
        ctx.on_backward = on_backward
        return tensors[0] if len(tensors) == 1 else tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


class Stage3Parameters:
    """The units, their buffers and hooks of one module whose parameters are partitioned in `groups`."""

    def __init__(self, module, groups, ctx, zero_config, compute_device):
        self.module, self.groups, self.ctx = module, groups, ctx
        self.prefetch_elements = int(zero_config.stage3_prefetch_bucket_size)
        self.max_live_elements = int(zero_config.stage3_max_live_parameters)
        self.max_reuse_elements = int(zero_config.stage3_max_reuse_distance)
        self.gather_timeout = DEFAULT_GATHER_TIMEOUT
        in_groups = {id(p) for g in groups for p in g.params}
        missing = [n for n, p in module.named_parameters() if id(p) not in in_groups]
        if missing:
            raise ValueError(f"ZeRO-3 partitions the optimizer's parameters; these are not in any optimizer param "
                             f"group: {missing[:5]}")
        self.units = _find_units(module)
        threshold = int(zero_config.stage3_param_persistence_threshold)
        persistent = [p for unit in self.units for p in unit.params if full_numel(p) <= threshold]
        persistent_ids = {id(p) for p in persistent}
        self.persistent = _Buffer("persistent parameters", persistent, groups, ctx, compute_device, True) \
            if persistent else None
        self.buffer_of = {id(p): self.persistent for p in persistent}
        self.buffers = [self.persistent] if self.persistent else []
        for unit in self.units:
            own = [p for p in unit.params if id(p) not in persistent_ids]
            if own:
                buffer = _Buffer(unit.name, own, groups, ctx, compute_device)
                self.buffers.append(buffer)
                self.buffer_of.update({id(p): buffer for p in own})
        for unit in self.units:
            needed = [self.buffer_of[id(p)] for p in unit.params + unit.external]
            unit.buffers = list({id(b): b for b in needed}.values())
        for buffer in self.buffers:
            buffer.release()
        for group in groups:
            for p in group.params:
                p.ds_manager = self
        self.on_partition_edited = lambda param: None    # the engine refreshes the fp32 masters
        self.order, self.order_recorded = [], False
        self.release_order = []          # units by the end of their forward (the first one's), recorded with `order`
        self.reused = set()              # ids of the buffers kept gathered from the forward into the backward
        self.live_elements = 0
        self.handles = []
        self.hooks_bypassed = False      # gathered_for_inference: the per-unit hooks do nothing

    # ---- hooks ---------------------------------------------------------------------------------------------
    def install_hooks(self):
        """Module hooks, and gradient hooks that must run after the gradient buckets' (installed before)."""
        for unit in self.units:
            self.handles.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._pre_forward(unit, args)))
            self.handles.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output)))
        for buffer in self.buffers:
            for p in buffer.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        lambda param, buffer=buffer: self._gradient_arrived(buffer, param)))

    def _pre_forward(self, unit, args):
        if self.hooks_bypassed:
            return None
        in_backward = _in_backward()
        if not self.order_recorded and not in_backward:
            self.order.append(unit)
        self.fetch(unit, backward=in_backward)
        if not in_backward:
            for buffer in unit.buffers:
                buffer.holders += 1
        wrapped = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
        if not (torch.is_grad_enabled() and wrapped and any(b.has_frozen for b in unit.buffers)):
            return None
        outputs = _CallInBackward.apply(lambda: self.inputs_reached(unit), *(args[i] for i in wrapped))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        args = list(args)
        for i, output in zip(wrapped, outputs):
            args[i] = output
        return tuple(args)

    def inputs_reached(self, unit):
        """The backward of `unit` has produced its inputs' gradients: its frozen parameters are done with."""
        for buffer in unit.buffers:
            if buffer.has_frozen:
                buffer.inputs_reached = True
                self._gradient_arrived(buffer, None)

    def _post_forward(self, unit, output):
        if self.hooks_bypassed:
            return output
        if not _in_backward():
            if not self.order_recorded:
                self.release_order.append(unit)
            keep = self.reused if torch.is_grad_enabled() else ()
            for buffer in unit.buffers:
                buffer.holders -= 1
                if buffer.holders == 0 and not buffer.persistent and id(buffer) not in keep:
                    self._release(buffer)
        if torch.is_grad_enabled():
            return tree_map(lambda t: _CallInBackward.apply(lambda: self.fetch(unit, backward=True), t)
                            if torch.is_tensor(t) and t.requires_grad else t, output)
        return output

    def _gradient_arrived(self, buffer, param):
        buffer.pending_grads.discard(id(param))
        done = not buffer.pending_grads and (buffer.inputs_reached or not buffer.has_frozen)
        if done and buffer.holders == 0 and not buffer.persistent:
            self._release(buffer)

    # ---- gather / release ----------------------------------------------------------------------------------
    def fetch(self, unit, backward=False):
        """Make every buffer of `unit` ready (waiting for a prefetch in flight), then prefetch what comes next."""
        for buffer in unit.buffers:
            self._start(buffer)
        for buffer in unit.buffers:
            self._finish(buffer, unit.name)
        if backward:
            for buffer in unit.buffers:
                if buffer.state == "ready" and not buffer.pending_grads:
                    buffer.pending_grads = {id(p) for p in buffer.params if p.requires_grad}
                    buffer.inputs_reached = False
        self._prefetch(unit, backward)

    def _start(self, buffer):
        if buffer.state == "released" or (buffer.persistent and buffer.stale and buffer.state == "ready"):
            if buffer.state == "released":
                self.live_elements += buffer.numel
            buffer.start_gather()

    def _finish(self, buffer, name):
        if buffer.state == "in_flight":
            try:
                buffer.finish_gather(self.gather_timeout, name)
            except RuntimeError as e:
                if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                    raise           # a local failure (a shape error, ...), not ranks that did not join
                raise RuntimeError(
                    f"ZeRO-3: rank {dist.get_rank()} waited {self.gather_timeout} for the parameters of "
                    f"{name!r} and the other data-parallel ranks did not join: every data-parallel rank must run "
                    f"the same forwards (e.g. evaluate on all ranks, or read weights inside "
                    f"zero.GatheredParameters on all ranks) ({e})") from None

    def _release(self, buffer):
        if buffer.state != "released":
            self.live_elements -= buffer.numel
            buffer.release()
            buffer.pending_grads = set()

    def _prefetch(self, unit, backward):
        if not self.order_recorded or self.prefetch_elements <= 0 or unit not in self.order:
            return
        index = self.order.index(unit)
        following = self.order[index - 1::-1] if backward and index > 0 else [] if backward else \
            self.order[index + 1:]
        budget = self.prefetch_elements      # elements gathered ahead of use, those already in flight included
        for later in following:
            for buffer in later.buffers:
                if buffer.state != "released":
                    budget -= 0 if buffer.persistent else buffer.numel
                    continue
                if buffer.numel > budget or self.live_elements + buffer.numel > self.max_live_elements:
                    return
                budget -= buffer.numel
                self._start(buffer)

    # ---- the engine's calls --------------------------------------------------------------------------------
    def end_forward(self):
        if not self.order_recorded:
            self.order_recorded = True
            self.reused = self._buffers_to_reuse()
        if not torch.is_grad_enabled():
            self.release_all()

    def _buffers_to_reuse(self):
        """The buffers of the units that end the forward last (the first ones the backward needs), as many as
        fit in stage3_max_reuse_distance elements (and stage3_max_live_parameters): they stay gathered from the
        forward into the backward instead of being released and gathered again (a contiguous tail of the order:
        the first unit that does not fit ends it)."""
        budget = min(self.max_reuse_elements, self.max_live_elements)
        kept, total = set(), 0
        for unit in reversed(self.release_order):
            new = {id(b): b for b in unit.buffers if not b.persistent and id(b) not in kept}
            size = sum(b.numel for b in new.values())
            if total + size > budget:
                break
            total += size
            kept.update(new)
        return kept

    def release_all(self):
        """End of backward (and of a no-grad forward): nothing but the persistent parameters stays gathered."""
        self._release_unheld()

    @contextlib.contextmanager
    def swapped_partitions(self, partitions):
        """Run with `partitions` (one tensor per group, shaped like its partition) as the weights' partitions:
        forwards inside gather them instead (DPO's partitioned reference policy); the originals come back after.
        No gather may be held or in flight (none is between steps)."""
        self._release_unheld()          # buffers kept for the backward hold the other weights
        if any(b.state != "released" and b is not self.persistent for b in self.buffers):
            raise RuntimeError("ZeRO-3: swapped_partitions while parameters are gathered")
        own = [group.partition for group in self.groups]
        for group, partition in zip(self.groups, partitions):
            group.partition = partition
        self.after_step()
        try:
            yield
        finally:
            for group, partition in zip(self.groups, own):
                group.partition = partition
            self.after_step()

    def after_step(self):
        """The partitions changed: the persistent parameters are refreshed at their next use, and a buffer kept
        gathered for a backward that did not come (a forward with gradients, then no backward) is released."""
        self._release_unheld()
        if self.persistent is not None:
            self.persistent.stale = True
            self.persistent.publish_status()

    def _release_unheld(self):
        for buffer in self.buffers:
            if not buffer.persistent and buffer.holders == 0:
                self._release(buffer)

    def gather(self, params, own_storage=False):
        """Hold the buffers of `params` gathered until `release(params)`. `own_storage` (GatheredParameters: the
        client may keep `p.data`, or `p.data.cpu()`, which is the same tensor on the CPU): each of `params` gets a
        storage of its own instead of a view of its unit's buffer, so what the client keeps (or saves:
        torch.save writes a view's whole storage) is that parameter alone, not the unit's other parameters."""
        buffers = list({id(self.buffer_of[id(p)]): self.buffer_of[id(p)] for p in params}.values())
        for buffer in buffers:
            self._start(buffer)
        for buffer in buffers:
            self._finish(buffer, buffer.name)
            buffer.holders += 1
        if own_storage:
            for p in params:
                p.data = p.data.clone()
            asked = {id(p) for p in params}
            for buffer in buffers:          # every parameter has its own copy: the flat storage is not needed
                if all(id(p) in asked for p in buffer.params):
                    buffer.storage = buffer.placeholder
        return buffers

    @contextlib.contextmanager
    def gathered_for_inference(self):
        """Every parameter whole for the body (each buffer gathered once, a collective of the data-parallel group:
        every rank enters), with the per-unit hooks bypassed: no gather, prefetch or forward-order recording per
        forward, so the ranks may run different numbers of no-grad forwards inside (generation of other prompts).
        Everything but the persistent parameters is released on exit, exceptions included."""
        held = self.gather([p for buffer in self.buffers for p in buffer.params])
        self.hooks_bypassed = True
        try:
            yield
        finally:
            self.hooks_bypassed = False
            self.release(held)

    def release(self, buffers, keep_edits=True):
        """Drop a hold taken by gather(). `keep_edits=False` (GatheredParameters without a modifier rank: DeepSpeed
        frees every parameter of the context on exit, so edits made inside are lost): the persistent buffer, which
        stays gathered, is marked stale, so its next use gathers the partitions again instead of keeping them."""
        for buffer in buffers:
            buffer.holders -= 1
            if buffer.holders == 0 and not buffer.persistent:
                self._release(buffer)
            elif buffer.holders == 0 and not keep_edits:
                buffer.stale = True
                buffer.publish_status()

    def write_partition(self, param, full):
        """Copy this rank's range of `param` from its full value (flat or shaped) into the partition."""
        value = full.reshape(-1)
        for group in self.groups:
            for index, p in enumerate(group.params):
                if p is param:
                    p_start, p_end = group.offsets[index]
                    start, end = group.own_range
                    lo, hi = max(p_start, start), min(p_end, end)
                    if lo < hi:
                        with torch.no_grad():
                            group.partition[lo - start:hi - start].copy_(value[lo - p_start:hi - p_start])
                    return
        raise KeyError("parameter is not partitioned by this engine")

    def full_state_dict(self, keep=True):
        """The module's state dict with every parameter whole, in host memory, gathered one buffer at a time
        (every data-parallel rank takes part; with keep=False nothing is copied here)."""
        names = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        state = self.module.state_dict()
        for buffer in self.buffers:
            held = self.gather(buffer.params)
            for p in buffer.params if keep else []:
                copy = p.detach().to("cpu", copy=True)
                for name in names.get(id(p), []):
                    state[name] = copy
            self.release(held)
        return state

    def live_parameter_elements(self):
        """Elements gathered now (ready or in flight), the persistent buffer included."""
        return sum(b.numel for b in self.buffers if b.state != "released")

    def remove_hooks(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _find_units(module):
    """ModuleList elements (whole subtrees) and the other modules with parameters of their own; a parameter
    belongs to the first unit that reaches it and is external to any later one."""
    units, owned = [], set()

    def add(name, mod, params, external):
        own = [p for p in params if id(p) not in owned]
        owned.update(id(p) for p in own)
        extra = [p for p in params + external if all(p is not q for q in own)]
        if own or extra:
            units.append(Unit(name, mod, own, list({id(p): p for p in extra}.values())))

    def visit(mod, name):
        if isinstance(mod, nn.ModuleList):
            for index, child in enumerate(mod):
                external = [p for sub in child.modules() for p in sub.__dict__.get("_zero_external_params", [])]
                add(f"{name}.{index}", child, list(child.parameters()), external)
            return
        add(name or "(root)", mod, list(mod.parameters(recurse=False)),
            list(mod.__dict__.get("_zero_external_params", [])))
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(module, "")
    return units
