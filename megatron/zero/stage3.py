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

Resident: at data-parallel size 1 there is nothing to shard. A group partitioned over one rank (dp 1; an expert
group at expert-data-parallel size 1, also beside dense groups at dp 2) and not offloaded is its own partition: its
parameters stay views of it, in *resident* buffers (a unit's resident parameters in a buffer of their own): no
gather, release, hook or copy after a step (the optimizer writes the partition), `ds_status` AVAILABLE. At dp 1 a
step runs no per-unit Python work (ZeRO-3 was 6-9% slower than ZeRO-2 there, issue 54). DeepSpeed gathers at dp 1
too; `stage3_resident_at_dp1: false` restores that path. swapped_partitions re-points the views; GatheredParameters
hands out copies and re-points the parameters on exit (the edits written into the partition first, or lost).

Gathering one contiguous run [lo, hi) of a group's flat order is one broadcast from each rank owning part of
it, into the buffer's slice. Every rank must run the same forwards: a rank that runs a forward alone waits for
gathers nobody else joins; it raises (naming the unit) after `gather_timeout`, instead of hanging.

Here: the units and their hooks (Stage3Parameters). The partitions and their construction are stage3_partition.py's
(PartitionedGroup, partition_parameters), a buffer's gather and release stage3_buffer.py's (_Buffer,
wait_for_gather).
"""
import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from mpu.utils import full_numel

# The partitions (stage3_partition.py) and a unit's gathered storage (stage3_buffer.py), defined here before the
# split: importable from here as they were (stage3._Buffer is the class the hooks below build).
from .stage3_buffer import _Buffer, resident_group, wait_for_gather  # noqa: F401
from .stage3_partition import PartitionedGroup, partition_parameters  # noqa: F401

DEFAULT_GATHER_TIMEOUT = datetime.timedelta(minutes=5)


class Unit:
    def __init__(self, name, module, params, external):
        self.name, self.module = name, module
        self.params, self.external = params, external
        self.buffers = []          # the _Buffers this unit needs gathered (own, external owners', persistent)


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
        allowed = zero_config.stage3_resident_at_dp1     # False: the gather path at dp 1 too
        resident_ids = {id(p) for g in groups if allowed and resident_group(g, ctx) for p in g.params}
        threshold = int(zero_config.stage3_param_persistence_threshold)
        persistent = [p for unit in self.units for p in unit.params
                      if full_numel(p) <= threshold and id(p) not in resident_ids]
        persistent_ids = {id(p) for p in persistent}
        self.persistent = _Buffer("persistent parameters", persistent, groups, ctx, compute_device, True) \
            if persistent else None
        self.buffer_of = {id(p): self.persistent for p in persistent}
        self.buffers = [self.persistent] if self.persistent else []
        for unit in self.units:
            own = [p for p in unit.params if id(p) not in persistent_ids]
            # a unit's parameters in resident groups (an MoE layer's experts at expert-data-parallel size 1 beside
            # its dense weights at dp 2) get a buffer of their own: resident or not is decided per buffer
            for params, name in (([p for p in own if id(p) not in resident_ids], unit.name),
                                 ([p for p in own if id(p) in resident_ids], f"{unit.name} (resident)")):
                if params:
                    buffer = _Buffer(name, params, groups, ctx, compute_device, resident=allowed)
                    self.buffers.append(buffer)
                    self.buffer_of.update({id(p): buffer for p in params})
        for unit in self.units:
            needed = [self.buffer_of[id(p)] for p in unit.params + unit.external]
            unit.buffers = list({id(b): b for b in needed}.values())
        for buffer in self.buffers:
            if buffer.resident:
                buffer.attach()
            else:
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
        """Module hooks, and gradient hooks that must run after the gradient buckets' (installed before). None
        where nothing is gathered: a unit whose buffers are all resident has no hooks (at dp 1 no unit has), a
        resident buffer no gradient hooks (the buckets' own hooks take the gradients as at any size)."""
        for unit in self.units:
            if all(buffer.resident for buffer in unit.buffers):
                continue
            self.handles.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._pre_forward(unit, args)))
            self.handles.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output)))
        for buffer in self.buffers:
            for p in buffer.params if not buffer.resident else []:
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
                if buffer.state == "ready" and not buffer.pending_grads and not buffer.resident:
                    buffer.pending_grads = {id(p) for p in buffer.params if p.requires_grad}
                    buffer.inputs_reached = False
        self._prefetch(unit, backward)

    def _start(self, buffer):
        if buffer.resident:
            return
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
        if buffer.state != "released" and not buffer.resident:
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
                    budget -= 0 if buffer.persistent or buffer.resident else buffer.numel
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
            new = {id(b): b for b in unit.buffers if not b.persistent and not b.resident and id(b) not in kept}
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
        if any(b.state != "released" and b is not self.persistent and (b.holders or not b.resident)
               for b in self.buffers):
            raise RuntimeError("ZeRO-3: swapped_partitions while parameters are gathered")
        own = [group.partition for group in self.groups]
        for group, partition in zip(self.groups, partitions):
            group.partition = partition
        self.after_step()
        self._attach_resident()         # the resident parameters view the swapped partitions
        try:
            yield
        finally:
            for group, partition in zip(self.groups, own):
                group.partition = partition
            self.after_step()
            self._attach_resident()

    def _attach_resident(self):
        for buffer in self.buffers:
            if buffer.resident:
                buffer.attach()

    def after_step(self):
        """The partitions changed: the persistent parameters are refreshed at their next use, and a buffer kept
        gathered for a backward that did not come (a forward with gradients, then no backward) is released."""
        self._release_unheld()
        if self.persistent is not None:       # (never resident: the resident groups' small parameters are not in it)
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
            if buffer.holders == 0 and buffer.resident:
                buffer.attach()         # views of the partition again: the client's copies (own_storage) dropped,
                #                         their edits written into the partition before (modifier_rank) or lost
            elif buffer.holders == 0 and not buffer.persistent:
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
        """Elements gathered now (ready or in flight), the persistent and the resident buffers included."""
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
