"""The partitioned optimizer: fp32 master slices, the step recipe, and its re-partitionable state.

It wraps the client's torch optimizer (Adam/AdamW) *in place*: each of its param groups is re-pointed at this
rank's fp32 master slice of that group's flat buffer, so a learning-rate scheduler built on the client optimizer
keeps working. In fp32 the master slice is a view of the parameters' own flat buffer (no copy).

    step():  0. the client set `skip_step`: zero gradients, clear it, return False
             0b. `replica_sync` set (fault-tolerant replica groups, megatron/trainer/fault_tolerance.py): it averages
                the reduced partitions across the replica groups, rank for rank, and says whether the step commits;
                a discarded step zeroes gradients and returns False (`discarded` True)
             1. norm + overflow over all partitions, data- and model-parallel ranks
             2. loss-scaler update; on overflow: zero gradients, return False (every rank skips); in fp32/bf16 the
                same for a NaN/inf gradient when `skip_nonfinite` is set (the training loop sets it, then stops
                the run or counts the skip)
             3. master.grad = partition gradient x (clip coefficient / loss scale)
             4. inner optimizer step on the fp32 master slices (in tiles of sub_group_size elements; offloaded:
                on the host, torch's fused CPU Adam unless the client chose a kernel, see _host_kernel)
             5. copy slices into the low-precision parameters; launch the slices' all-gathers (param_gather.py):
                with overlap_param_gather they complete during the next forward, otherwise here
             6. zero gradients; return True
"""
import functools

import torch
import torch.distributed as dist

from .bucketing import BoundaryReducer, BucketReducer
from megatron.checkpoint.layout import (ADAM_KINDS, DATA_PARALLEL_RANK, DATA_PARALLEL_SIZE, END, GROUPS, LOSS_SCALER,
                                        MASTER, MUON_KINDS, NUMEL, PARAM_GROUPS, SCALAR_STATE, SLICE_STATE, START,
                                        ZERO_STAGE)
from megatron.checkpoint.optimizer_kind import check_other_optimizer
from . import offload as offload_memory
from .grad_norm import clip_coefficient, global_norm_and_overflow
from .muon import Muon, MuonError, partition_update
from .param_gather import ParameterGather
from megatron.fp16.loss_scaler import LossScaler, LossScalerConfig
from .partition import context_for, context_of, FlatGroup


class ZeroOptimizer:
    """Partitioned mixed-precision wrapper. Exposes `cur_scale`, `overflow`, `param_groups` like DeepSpeed's."""

    def __init__(self, optimizer, ctx, zero_config, fp16_config=None, gradient_clipping=0.0,
                 param_order=(), groups=None):
        """`groups`: the flat groups, one per optimizer param group, when the caller built them (stage 3's
        PartitionedGroup); otherwise FlatGroups are built here. With offload_optimizer the fp32 masters, the
        moments and the reduced gradient partitions live in host memory and the inner optimizer steps there."""
        self.optimizer, self.ctx, self.stage = optimizer, ctx, zero_config.stage
        self.zero_config = zero_config
        self.gradient_clipping = gradient_clipping
        self.fp16 = fp16_config is not None and fp16_config.enabled
        scaler_config = fp16_config.loss_scaler_config() if self.fp16 else LossScalerConfig(loss_scale=1.0)
        self.loss_scaler = LossScaler(scaler_config)
        self.overflow = False
        self.last_grad_norm = None
        # fp32/bf16 (no loss scaler): with skip_nonfinite a NaN/inf gradient skips the step like an fp16 overflow
        # (parameters and optimizer state untouched); last_nonfinite_param is this rank's first parameter (group
        # order, flat order) whose own-partition gradient was non-finite, or None.
        self.skip_nonfinite = False
        self.last_nonfinite_param = None
        self.groups = groups if groups is not None else [self._flat_group(g["params"]) for g in optimizer.param_groups]
        self.experts = [group.context is not None for group in self.groups]   # expert groups (expert parallelism)
        offload = zero_config.offload_optimizer
        # Muon halves: orthogonalized here (partition_update) from whole matrices, their flat masters never tiled
        self.muon_groups = [bool(g.get("use_muon")) for g in optimizer.param_groups] \
            if isinstance(optimizer, Muon) else [False] * len(optimizer.param_groups)
        if any(self.muon_groups) and offload.enabled:
            raise MuonError("Muon with zero_optimization.offload_optimizer is not supported: remove the offload "
                            "block, or use the AdamW optimizer")
        self.host = offload_memory.HOST if offload.enabled else None
        self.masters = [self._new_master(g, self.host, offload.pin_memory) for g in self.groups]
        optimizer.state.clear()
        # the inner optimizer steps each master in tiles of at most sub_group_size elements (views of it)
        self.tiles = [list(m.split(zero_config.sub_group_size))
                      if m.numel() > zero_config.sub_group_size and not muon else [m]
                      for m, muon in zip(self.masters, self.muon_groups)]
        for group, tiles in zip(optimizer.param_groups, self.tiles):
            group["params"] = tiles
            if self.host is not None:
                group.update(_host_kernel(optimizer, group))
        params = list(param_order)
        # where collectives run: the compute device (the parameters'), also when partitions and gradients live in
        # host memory (offload): NCCL takes device tensors only
        self.collective_device = params[0].device if params else torch.device("cpu")
        if self.stage >= 2:
            self.reducer = BucketReducer(self.groups, ctx, zero_config, param_order, self.collective_device,
                                         gradient_device=self.host)
        else:
            self.reducer = BoundaryReducer(self.groups, ctx, self.stage, zero_config)
        self.norm_ranges = [g.counted_own_ranges(ctx.model_parallel_rank, ctx.model_parallel_size)
                            for g in self.groups]
        self.param_gather = ParameterGather(self.groups if self.stage in (1, 2) else [], ctx.data_parallel_group,
                                            zero_config.allgather_bucket_size, param_order)
        # a client's request to skip the next step (DeepSpeed-Chat's --align_overflow: when the actor overflows the
        # critic skips too); step() honours it once and clears it
        self.skip_step = False
        # the one hook where replica groups meet: replica_sync(partition_grads) -> commit (bool), or None (one group)
        self.replica_sync = None
        self.discarded = False
        self.resident_parameter_bytes = 0     # stage 3: the persistent parameters' buffer (set by the engine)
        self.frozen_parameter_bytes = 0       # parameters in no group (requires_grad False; set by the engine)

    def _flat_group(self, params):
        """A FlatGroup of `params` partitioned over the data-parallel group, or, for expert parameters under expert
        parallelism, over the expert-data-parallel group (partition.context_for)."""
        context = context_for(params, self.ctx)
        data_parallel = context or self.ctx
        group = FlatGroup(params, data_parallel.data_parallel_size if self.stage >= 1 else 1,
                          data_parallel.data_parallel_rank)
        group.context = context
        return group

    @staticmethod
    def _new_master(group, host, pin_memory):
        partition = group.own_partition()
        if host is not None:                       # offload: always a host copy, even of an fp32 host partition
            return offload_memory.host_copy(partition, torch.float32, pin_memory)
        if partition.dtype in (torch.float32, torch.float64):
            return partition                       # fp32 (fp64): the parameters' own slice is the master
        return partition.detach().float()

    # ---- DeepSpeed-style accessors -------------------------------------------------------------------------
    @property
    def cur_scale(self):
        return self.loss_scaler.cur_scale

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=None):
        self.reducer.zero()

    def check_overflow(self, partition_gradients=True, external=False):
        """Whether any rank's reduced gradients hold an inf or NaN, into `overflow` (DeepSpeed's ZeRO optimizers);
        also returned, which DeepSpeed 0.19.8 does not do (it returns None and has no `external` keyword: the
        DeepSpeed-Chat call check_overflow(external=True) is a TypeError there). Collective over every rank; call
        it after backward() at the accumulation boundary, before step(). `partition_gradients`, `external`:
        accepted, no effect (the reduced partitions are always what is checked)."""
        self.param_gather.wait_all()
        partition_grads = [self.reducer.partition_grad(i) for i in range(len(self.groups))]
        _, found_inf = global_norm_and_overflow(partition_grads, self.norm_ranges, self.ctx, self.collective_device,
                                                self.cur_scale, partitioned=self.stage >= 1,
                                                experts=self.experts)
        self.overflow = bool(found_inf)
        return self.overflow

    def quantize_nontrainable_params(self):
        """DeepSpeed's ZeRO-3 re-quantizes frozen weights here when zero_quantized_nontrainable_weights is on, and
        otherwise warns and does nothing; this engine never quantizes weights, so: nothing, said on rank 0."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("[zero] quantize_nontrainable_params(): no effect (weights are never quantized here)", flush=True)

    # ---- the step ------------------------------------------------------------------------------------------
    def backward(self, loss, accumulation_steps=1):
        """Scale the loss (loss scale / accumulation steps) and backpropagate."""
        if self.stage < 2:
            self.reducer.attach_grad_views()
        (loss.float() * (self.cur_scale / accumulation_steps)).backward()

    def finish_micro_step(self, boundary):
        """Reduce what this micro-step produced (stage 2) or everything accumulated (stage 0/1 at a boundary)."""
        self.reducer.finish_micro_step(boundary)

    def step(self):
        self.param_gather.wait_all()   # a gather still in flight reads the partitions this step rewrites
        if self.skip_step:             # the client asked to skip this one: as an overflow, without a scale change
            self.skip_step = False
            self.reducer.zero()
            return False
        partition_grads = [self.reducer.partition_grad(i) for i in range(len(self.groups))]
        self.discarded = self.replica_sync is not None and not self.replica_sync(partition_grads)
        if self.discarded:
            self.reducer.zero()
            return False
        norm, found_inf = global_norm_and_overflow(partition_grads, self.norm_ranges, self.ctx, self.collective_device,
                                                   self.cur_scale, partitioned=self.stage >= 1,
                                                   experts=self.experts)
        self.overflow = found_inf and self.fp16
        scale = self.cur_scale
        if self.fp16:
            self.loss_scaler.update(found_inf)
        self.last_grad_norm = norm
        self.last_nonfinite_param = None
        if found_inf and not self.fp16 and self.skip_nonfinite:
            self.last_nonfinite_param = self._first_nonfinite_param(partition_grads)
            self.reducer.zero()
            return False
        if self.overflow:
            self.reducer.zero()
            return False
        factor = clip_coefficient(norm, self.gradient_clipping) / scale
        for index, (master, tiles, grad) in enumerate(zip(self.masters, self.tiles, partition_grads)):
            grad = grad.to(master.device, master.dtype)   # itself when already fp32 (fp64) there
            if factor != 1.0:
                grad.mul_(factor)
            if self.muon_groups[index]:
                grad = self._muon_update(index, master, grad)
            for tile, piece in zip(tiles, grad.split(tiles[0].numel()) if len(tiles) > 1 else [grad]):
                tile.grad = piece
        self.optimizer.step()
        for group, master, tiles in zip(self.groups, self.masters, self.tiles):
            for tile in tiles:
                tile.grad = None
            partition = group.own_partition()
            if partition.data_ptr() != master.data_ptr():
                partition.copy_(master)
        self.param_gather.launch()
        if not self.zero_config.overlap_param_gather:
            self.param_gather.wait_all()
        self.reducer.zero()
        return True

    def _muon_update(self, index, master, grad):
        """The orthogonalized update of Muon half `index` (its momentum partitioned like Adam's moments)."""
        state = self.optimizer.state.setdefault(master, {})
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(master)
        ctx = context_of(self.groups[index], self.ctx)     # an expert group's: its expert-data-parallel group
        model_parallel = (ctx.model_parallel_group, ctx.model_parallel_rank, ctx.model_parallel_size)
        return partition_update(grad, state["momentum_buffer"], self.groups[index], self.optimizer.param_groups[index],
                                ctx.data_parallel_group, model_parallel)

    def _first_nonfinite_param(self, partition_grads):
        for group, grad in zip(self.groups, partition_grads):
            bad = (~torch.isfinite(grad)).nonzero()
            if bad.numel():
                offset = group.own_range[0] + int(bad[0])
                for index, _, _ in group.segments(offset, offset + 1):
                    return group.params[index]
        return None

    # ---- memory accounting (tests, benchmark) --------------------------------------------------------------
    def partitioned_state_bytes(self):
        """Bytes of fp32 master slices (those that are copies), optimizer moments and held gradients."""
        masters = sum(m.numel() * m.element_size() for m, g in zip(self.masters, self.groups)
                      if m.data_ptr() != g.own_partition().data_ptr())
        moments = sum(v.numel() * v.element_size() for state in self.optimizer.state.values()
                      for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"master": masters, "moments": moments, "gradients": self.reducer.held_gradient_bytes(),
                "parameters": sum(g.parameter_bytes() for g in self.groups) + self.resident_parameter_bytes
                + self.frozen_parameter_bytes}

    def offloaded_kinds(self):
        """The kinds of partitioned_state_bytes() that offload keeps in host memory (the persistent stage-3
        parameters stay on the device)."""
        kinds = {"master", "moments"} | ({"gradients"} if self.stage >= 2 else set()) if self.host is not None \
            else set()
        return kinds | ({"parameters"} if any(getattr(g, "offloaded", False) for g in self.groups) else set())

    def state_devices(self):
        """Where each kind of state lives: {"master", "moments", "gradients", "parameters"} -> device."""
        moments = [v.device for state in self.optimizer.state.values() for v in state.values()
                   if torch.is_tensor(v) and v.dim() > 0]
        return {"master": self.masters[0].device if self.masters else None,
                "moments": moments[0] if moments else None,
                "gradients": self.reducer.partition_grad(0).device if self.groups else None,
                "parameters": self.groups[0].device if self.groups else None}

    # ---- checkpoint state: this rank's unpadded slice, re-partitionable ------------------------------------
    def partitioned_state_dict(self):
        groups = []
        for index, (group, master) in enumerate(zip(self.groups, self.masters)):
            start, end = group.own_unpadded_range()
            own_start = group.own_range[0]
            state = self._master_state(index)
            groups.append({NUMEL: group.numel, START: start, END: end,
                           MASTER: _host_copy(master[start - own_start:end - own_start]),
                           SLICE_STATE: {k: _host_copy(v[start - own_start:end - own_start]) for k, v in state.items()
                                         if torch.is_tensor(v) and v.shape == master.shape},
                           SCALAR_STATE: {k: v for k, v in state.items()
                                          if not (torch.is_tensor(v) and v.shape == master.shape)}})
        return {ZERO_STAGE: self.stage, DATA_PARALLEL_SIZE: self.ctx.data_parallel_size,
                DATA_PARALLEL_RANK: self.ctx.data_parallel_rank, LOSS_SCALER: self.loss_scaler.state_dict(),
                PARAM_GROUPS: [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                GROUPS: groups}

    def state_dict(self):
        """This rank's partitioned state (DeepSpeed's ZeRO optimizer returns its partition too)."""
        return self.partitioned_state_dict()

    def load_state_dict(self, state):
        """A dict from `state_dict()` when it covers everything (data parallel 1, or stage 0), or the list of all
        saved data-parallel ranks' dicts."""
        self.load_partitioned_state_dicts(state if isinstance(state, list) else [state])

    def load_partitioned_state_dicts(self, states, expert_states=None):
        """Load this rank's range from the files of *all* saved data-parallel ranks (any data-parallel size) of this
        mp rank. Only the pieces that overlap this rank's range are copied, so with memory-mapped loads a process
        reads its own share only. The parameters themselves come from the module weights (loaded before).
        `expert_states`: the files holding this rank's experts, for the expert groups (expert parallelism: the
        saved ranks at this rank's expert-parallel position; None: `states`)."""
        self.param_gather.wait_all()   # an in-flight gather still reads the masters (fp32) rewritten here
        if len(states[0][GROUPS]) != len(self.groups):
            raise ValueError(f"checkpoint has {len(states[0][GROUPS])} optimizer param groups, "
                             f"the optimizer has {len(self.groups)}")
        for index, (group, master) in enumerate(zip(self.groups, self.masters)):
            saved = [s[GROUPS][index] for s in (expert_states if self.experts[index] and expert_states is not None
                                                else states)]
            if saved[0][NUMEL] != group.numel:
                raise ValueError(f"optimizer param group {index}: checkpoint has {saved[0][NUMEL]} elements, "
                                 f"the model has {group.numel}")
            covered = sum(s[END] - s[START] for s in saved)
            if covered < group.numel:
                raise ValueError(f"checkpoint slices cover {covered} of {group.numel} elements: a data-parallel "
                                 "rank's optimizer file is missing")
            start, end = group.own_unpadded_range()
            state = _scalar_state_on_device(saved[0][SCALAR_STATE], self.optimizer.param_groups[index], master)
            with torch.no_grad():
                master.zero_()
                _copy_own_range(saved, lambda s: s[MASTER], master, start, end)
                for key in saved[0][SLICE_STATE]:
                    value = torch.zeros_like(master)
                    _copy_own_range(saved, lambda s, key=key: s[SLICE_STATE][key], value, start, end)
                    state[key] = value
            self._set_master_state(index, state)
        for group, saved in zip(self.optimizer.param_groups, states[0][PARAM_GROUPS]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.loss_scaler.load_state_dict(states[0][LOSS_SCALER])

    def load_full_state(self, tensor_of, scalar_states, hyperparameters, loss_scaler_state):
        """Load from a checkpoint of another topology or path (megatron.checkpoint.reshard): `tensor_of(param, kind)` is this
        model-parallel rank's fp32 tensor of a module parameter for kind "master", "exp_avg" or "exp_avg_sq"
        ("momentum_buffer" in Muon's half; None: not saved). Only the parameters that overlap this rank's range are
        asked for."""
        self.param_gather.wait_all()   # as in load_partitioned_state_dicts
        for index, (group, master) in enumerate(zip(self.groups, self.masters)):
            start, end = group.own_unpadded_range()
            held = self._master_state(index)   # reuse this rank's moment buffers when they exist
            kinds = MUON_KINDS if self.muon_groups[index] else ADAM_KINDS
            values = {kind: held[kind].zero_() if kind in held else torch.zeros_like(master) for kind in kinds}
            with torch.no_grad():
                master.zero_()
                for param_index, lo, hi in group.segments(start, end):
                    param, param_start = group.params[param_index], group.offsets[param_index][0]
                    for kind, target in (("master", master), *values.items()):
                        tensor = tensor_of(param, kind)
                        if tensor is None:
                            check_other_optimizer(tensor_of, param, kind)
                            values.pop(kind, None)
                            continue
                        target[lo - start:hi - start].copy_(tensor.reshape(-1)[lo - param_start:hi - param_start])
            state = _scalar_state_on_device(scalar_states[index] if index < len(scalar_states) else {},
                                            self.optimizer.param_groups[index], master)
            self._set_master_state(index, {**{k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()},
                                           **values} if len(values) == len(kinds) else {})
        for group, saved in zip(self.optimizer.param_groups, hyperparameters or []):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if loss_scaler_state is not None and self.fp16:
            self.loss_scaler.load_state_dict(loss_scaler_state)

    def _master_state(self, index):
        """The inner optimizer's state of group `index` as one dict over the whole master (tiles concatenated)."""
        tiles = self.tiles[index]
        states = [self.optimizer.state.get(tile, {}) for tile in tiles]
        if len(tiles) == 1 or not states[0]:
            return states[0]
        return {k: torch.cat([s[k] for s in states]) if torch.is_tensor(v) and v.shape == tiles[0].shape else v
                for k, v in states[0].items()}

    def _set_master_state(self, index, state):
        """Inverse of _master_state: whole-master tensors cut into the tiles' states."""
        tiles, master = self.tiles[index], self.masters[index]
        for tile in tiles:
            self.optimizer.state.pop(tile, None)
        if not state:
            return
        if len(tiles) == 1:
            self.optimizer.state[tiles[0]] = state
            return
        offset = 0
        for tile in tiles:
            self.optimizer.state[tile] = {
                k: v[offset:offset + tile.numel()].clone() if torch.is_tensor(v) and v.shape == master.shape
                else v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            offset += tile.numel()

    def refresh_masters_from_parameters(self):
        """After loading module weights only: the fp32 master slices follow the parameters."""
        with torch.no_grad():
            for group, master in zip(self.groups, self.masters):
                partition = group.own_partition()
                if partition.data_ptr() != master.data_ptr():
                    master.copy_(partition)


@functools.lru_cache(maxsize=None)
def adam_kernel_options(device, dtype=torch.float32):
    """The fastest torch Adam kernel that steps `dtype` tensors on `device`: {"fused": True}, else
    {"foreach": True}, else {} (torch's default). Decided by one probe step on a 1-element tensor, so the answer
    follows the installed torch rather than a list of devices. Both the engine and Megatron's FP16_Optimizer step
    fp32 masters, hence the default dtype."""
    for options in ({"fused": True}, {"foreach": True}):
        try:
            probe = torch.zeros(1, dtype=dtype, device=device, requires_grad=True)
            probe.grad = torch.ones_like(probe)
            torch.optim.AdamW([probe], lr=1e-3, **options).step()
            return options
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            continue
    return {}


def _host_kernel(optimizer, group):
    """Kernel options for a param group the offloaded optimizer steps on the host, where the client chose none:
    a torch Adam/AdamW gets the fastest kernel torch runs on the CPU (`fused`: one vectorised pass per tile, where
    this torch has it; else `foreach`), any other optimizer `foreach`. A client's explicit choice is kept, and its
    `fused=False` gets `foreach`."""
    if group.get("fused") or group.get("foreach") is not None:
        return {}
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if adam and group.get("fused") is None and not group.get("capturable") and not group.get("differentiable"):
        return adam_kernel_options(torch.device("cpu"))
    return {"foreach": True}


def _host_copy(tensor):
    """In host memory: a device tensor copied (a device clone would briefly double this rank's optimizer state
    on the GPU during a save: the partitioned state is exactly what ZeRO frees room for); a host tensor as it is,
    a view (a copy would double this rank's state in host memory; torch.save then writes its storage, the
    partition, whose padding is at most 32 x dp elements). A background save clones it (layout.host_copy)."""
    tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu", copy=True)


def _copy_own_range(saved, get, target, start, end):
    """target[:end - start] = the unpadded flat range [start, end), from the saved per-rank [START, END) slices
    (only the overlapping pieces are touched)."""
    for s in saved:
        lo, hi = max(start, s[START]), min(end, s[END])
        if lo < hi:
            target[lo - start:hi - start].copy_(get(s)[lo - s[START]:hi - s[START]])


def _scalar_state_on_device(scalar_state, param_group, master):
    """Adam's `step` lives on the CPU for torch's default kernels, but on the parameter's device for fused or
    capturable ones (torch's own load_state_dict makes the same choice)."""
    on_device = param_group.get("fused") or param_group.get("capturable")
    return {key: value.to(master.device) if on_device and torch.is_tensor(value) else value
            for key, value in scalar_state.items()}
