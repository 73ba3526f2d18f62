"""ZeroEngine's checkpoint writing, as a mixin of its methods: save_checkpoint (this rank's files, written
atomically: megatron.checkpoint.atomic_io), the DeepSpeed 0.19.8 keys those files also hold (every data-parallel
rank's partitions re-cut into DeepSpeed's layout: megatron.checkpoint.deepspeed_format), save_16bit_model and
module_state_dict (the whole weights).

The methods read the engine's state (module, ctx, config, optimizer, stage3, lr_scheduler, the step counters);
loading a checkpoint stays in engine.py, as does `_pipeline_rank` (the stage in the file names), used by both.
"""
import os

import torch
import torch.distributed as dist

from mpu.utils import full_numel, full_shape
from megatron.checkpoint import atomic_io, deepspeed_format, layout as ckpt

from . import expert_checkpoint, offload
from .collectives import gather_intervals


class EngineSaving:
    """ZeroEngine's save methods (DeepSpeed's names: save_checkpoint, save_16bit_model, module_state_dict)."""


    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, async_save=False,
                        on_commit=None):
        """All ranks call this. Atomic: every rank writes its files (DESIGN.md section 6) into SAVE/<tag>.tmp/,
        rank 0 adds manifest.json (every rank's files, sizes and crc32), renames it to SAVE/<tag> and then writes
        `latest` (the commit point), then calls on_commit(). When any rank fails, every rank raises
        CheckpointError (none waits forever) and the previous checkpoint stays the latest.
        `async_save`: returns once the states are copied to host memory; the files are written in a background
        thread and published by the next save or load (megatron.checkpoint.atomic_io.finish_pending_save)."""
        if self.optimizer is None:
            raise RuntimeError("save_checkpoint of an engine without an optimizer is not supported here: save its "
                               "weights with save_16bit_model() or module_state_dict()")
        if self.ctx.expert_model_parallel_size > 1 and self.stage3 is not None:
            raise ckpt.CheckpointError("ZeRO-3 checkpoints under expert parallelism are not supported: save at "
                                       "ZeRO stage 0-2 or at --expert-model-parallel-size 1")
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        is_rank_0 = not dist.is_initialized() or dist.get_rank() == 0

        def write(directory):
            files = [(path, ckpt.host_copy(state, clone=async_save and atomic_io.background_writes_need_copies()))
                     for path, state in self._checkpoint_files(directory, client_state)]
            return lambda: [ckpt.atomic_torch_save(state, path) for path, state in files]

        def commit():
            if save_latest:
                ckpt.write_latest_tag(save_dir, tag)
            if on_commit is not None:
                on_commit()
        atomic_io.save_directory_atomically(os.path.join(save_dir, tag), write, commit, self.device, is_rank_0,
                                            error_class=ckpt.CheckpointError, background=async_save)
        return True

    def module_state_dict(self, keep=True):
        """The module's whole weights. Stage 3 gathers them one unit at a time into host memory (every
        data-parallel rank must call it; with keep=False this rank only takes part). module.state_dict() waits
        for the parameter gathers still in flight (ParameterGather.install_hooks)."""
        if self.stage3 is None:
            return self.module.state_dict()
        return self.stage3.full_state_dict(keep=keep)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin"):
        """The whole 16-bit (or fp32) weights in one file per model-parallel rank, written by data-parallel rank 0
        (every rank calls it). Stage 3 needs stage3_gather_16bit_weights_on_model_save, as in DeepSpeed."""
        if self.stage3 is not None and not self.config.zero_optimization.gather_16bit_weights_on_model_save:
            if dist.get_rank() == 0:
                print("[zero] save_16bit_model: not saved: set zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save to true", flush=True)
            return False
        state = self.module_state_dict(keep=self.ctx.data_parallel_rank == 0)
        if self.ctx.data_parallel_rank == 0:
            name = save_filename if self.ctx.model_parallel_size == 1 else \
                f"{save_filename}.mp_rank_{self.ctx.model_parallel_rank:02d}"
            os.makedirs(save_dir, exist_ok=True)
            ckpt.atomic_torch_save(state, os.path.join(save_dir, name))
        return True

    def _checkpoint_files(self, directory, client_state):
        """[(path, state)] of the files this rank writes: data-parallel rank 0 of every (tensor-parallel rank,
        stage) its model states; every rank its optimizer partition. Under pipelining each stage's module holds
        its layers under their global names. The files also hold what DeepSpeed reads (_deepspeed_keys).
        Collective (stage 3 gathers the module; the DeepSpeed layout exchanges partitions)."""
        mp_rank, pp_rank = self.ctx.model_parallel_rank, self._pipeline_rank()
        partitioned = self.stage3 is not None and not self.config.zero_optimization.gather_16bit_weights_on_model_save
        # ZeRO-3 saves each rank's slice of the weights in its own file: the whole model is gathered (into data-
        # parallel rank 0's host memory) only with stage3_gather_16bit_weights_on_model_save
        module_state = self._buffers_state() if partitioned else \
            self.module_state_dict(keep=self.ctx.data_parallel_rank == 0)
        module_state = expert_checkpoint.with_all_experts(module_state, self.module, self.ctx)   # every expert
        optimizer_state = self.optimizer.partitioned_state_dict()
        model_keys, optimizer_keys = self._deepspeed_keys(module_state, optimizer_state)
        files = []
        state = {ckpt.LR_SCHEDULER: self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 ckpt.GLOBAL_STEPS: self.global_steps, ckpt.SKIPPED_STEPS: self.skipped_steps,
                 ckpt.MICRO_STEPS: self.micro_steps, ckpt.CLIENT_STATE: dict(client_state or {}),
                 ckpt.DATA_PARALLEL_SIZE: self.ctx.data_parallel_size,
                 ckpt.MODEL_PARALLEL_SIZE: self.ctx.model_parallel_size,
                 ckpt.PIPELINE_PARALLEL_SIZE: self.ctx.pipeline_parallel_size,
                 ckpt.EXPERT_MODEL_PARALLEL_SIZE: self.ctx.expert_model_parallel_size,
                 ckpt.ZERO_STAGE: self.zero_optimization_stage(), ckpt.PARAM_NAMES: self._param_names(), **model_keys}
        if partitioned:
            state[ckpt.STAGE3_PARTITIONS] = self._stage3_partition_record()
        if self.ctx.data_parallel_rank == 0:
            files.append((os.path.join(directory, ckpt.model_states_name(mp_rank, pp_rank)),
                          {ckpt.MODULE: module_state, **state}))
        if self.stage3 is not None:   # every rank: its slice of the weights (and DeepSpeed's per-rank keys)
            rank_state = {ckpt.PARTITION_WEIGHTS: [
                {ckpt.START: start, ckpt.END: end, ckpt.WEIGHT: group.partition[:end - start]}
                for group in self.stage3.groups for start, end in [group.own_unpadded_range()]]}
            if model_keys:
                dtypes = {name: p.dtype for name, p in self.module.named_parameters()}
                rank_state.update(deepspeed_format.stage3_model_states(self.module, self._param_names(), state,
                                                                       dtypes))
            files.append((os.path.join(directory, ckpt.stage3_rank_states_name(
                self.ctx.data_parallel_rank, mp_rank, pp_rank)), rank_state))
        files.append((os.path.join(directory, ckpt.optim_states_name(  # bf16_ prefixed in a bf16 run, as DeepSpeed's
            self.ctx.data_parallel_rank, mp_rank, pp_rank, bf16=self.config.bf16.enabled)),
                      {**optimizer_state, **optimizer_keys}))
        return files

    def _buffers_state(self):
        """The module's persistent buffers (what a partitioned ZeRO-3 save keeps in the model-states file)."""
        buffers = dict(self.module.named_buffers())
        return {name: buffers[name].detach() for name in deepspeed_format.persistent_buffer_names(self.module)}

    def _stage3_partition_record(self):
        """layout.STAGE3_PARTITIONS: per stage-3 group (the frozen parameters' last) its names and whole shapes in
        flat order."""
        name_of = {id(p): name for name, p in self.module.named_parameters()}
        return [{"names": [name_of[id(p)] for p in group.params],
                 "shapes": [list(full_shape(p)) for p in group.params]} for group in self.stage3.groups]

    def _deepspeed_keys(self, module_state, optimizer_state):
        """(model-states keys, optimizer-states keys) DeepSpeed 0.19.8 reads, so that its zero_to_fp32 and
        load_checkpoint read our checkpoint (megatron.checkpoint.deepspeed_format); ({}, {}) where it cannot:
        stage 0 (DeepSpeed keeps no ZeRO files there), pipelining (its layer_* layout), frozen parameters at
        stage 3. Collective: every data-parallel rank's partitions are re-cut into DeepSpeed's layout."""
        stage = self.zero_optimization_stage()
        params = dict(self.module.named_parameters())
        frozen = [name for name, p in params.items() if not p.requires_grad]
        if stage == 0 or self.ctx.pipeline_parallel_size > 1 or (stage == 3 and frozen) or \
                self.ctx.expert_model_parallel_size > 1:     # DeepSpeed's layout has no expert groups of ours
            return {}, {}
        model_keys = deepspeed_format.model_states_keys(
            self.module, self._param_names(), {name: full_shape(p) for name, p in params.items()},
            self.ctx.data_parallel_size, self.ctx.model_parallel_size, self.ctx.pipeline_parallel_size,
            self.global_steps, self.train_batch_size(),
            frozen_weights={name: module_state[name] for name in frozen} if module_state else {})
        # the moments' names, the same on every rank (one that owns no element of a group may have none)
        kinds = sorted({key for saved in optimizer_state[ckpt.GROUPS] for key in saved[ckpt.SLICE_STATE]})
        if dist.is_initialized() and self.ctx.data_parallel_size > 1:
            every = [None] * self.ctx.data_parallel_size
            dist.all_gather_object(every, kinds, group=self.ctx.data_parallel_group)
            kinds = sorted(set().union(*every))
        masters, moments, scalars, paddings = [], [], [], []
        for group, saved in zip(self.optimizer.groups, optimizer_state[ckpt.GROUPS]):
            master, group_moments, padding = self._deepspeed_partition(group, saved, kinds)
            masters.append(master)
            moments.append(group_moments)
            paddings.append(padding)
            scalars.append(saved[ckpt.SCALAR_STATE])
        optimizer_keys = {deepspeed_format.OPTIMIZER_STATE_DICT: deepspeed_format.optimizer_state_dict(
            stage, self.ctx.data_parallel_size, masters, moments, scalars, optimizer_state[ckpt.PARAM_GROUPS],
            self.optimizer.loss_scaler, group_paddings=paddings,
            param_counts=[len(group.params) for group in self.optimizer.groups],
            clip_grad=self.config.gradient_clipping), deepspeed_format.DS_VERSION_KEY: deepspeed_format.DS_VERSION}
        return model_keys, optimizer_keys

    def _deepspeed_partition(self, group, saved, kinds):
        """This rank's (fp32 master, {moment: tensor}, end padding) of one flat group in DeepSpeed's layout (stages
        1-2: the master without the end padding, the moments with it; stage 3: every parameter's piece padded),
        re-cut from every rank's own range of ours (saved: this rank's, partitioned_state_dict's). One exchange
        per interval wanted (stages 1-2: the partition; stage 3: a parameter's piece), received in place: the
        host memory it adds is the result, plus a parameter's piece at stage 3."""
        dp, rank = self.ctx.data_parallel_size, self.ctx.data_parallel_rank
        owned = [tuple(min(x, group.numel) for x in group.partition_range(q)) for q in range(dp)]
        if self.stage3 is not None:
            layouts = [deepspeed_format.stage3_pieces([full_numel(p) for p in group.params], dp, q)
                       for q in range(dp)]
        else:
            layouts = [[deepspeed_format.stage12_partition(group.numel, dp, q)] for q in range(dp)]

        def recut(local):
            local = offload.to_device(local, self.device)
            result = local.new_zeros(sum(size for _, _, size in layouts[rank]))
            position = 0
            for index, (lo, hi, size) in enumerate(layouts[rank]):   # the same index on every rank

                def wanted_of(q, index=index):
                    q_lo, q_hi, _ = layouts[q][index]
                    return [(q_lo, q_hi)] if q_lo < q_hi else []
                gather_intervals(local, owned, wanted_of, self.ctx.data_parallel_group,
                                 out=result[position:position + hi - lo])
                position += size
            return result.cpu()
        master = recut(saved[ckpt.MASTER])
        own = saved[ckpt.SLICE_STATE]
        moments = {key: recut(own[key] if key in own else torch.zeros_like(saved[ckpt.MASTER])) for key in kinds}
        if self.stage3 is not None:
            return master, moments, 0
        lo, hi, size = layouts[rank][0]
        return master[:hi - lo], moments, size - (hi - lo)

    def _param_names(self):
        """Per flat group, the module's names of its parameters in flat order (how other topologies find them)."""
        name_of = {id(p): name for name, p in self.module.named_parameters()}
        return [[name_of.get(id(p), "") for p in group.params] for group in self.optimizer.groups]
