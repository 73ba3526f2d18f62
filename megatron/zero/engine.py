"""ZeroEngine: the model wrapper the training loop drives (DeepSpeed's engine API).

    engine, optimizer, _, lr_scheduler = zero.initialize(model=model, optimizer=adamw, config=ds_config, mpu=mpu)
    for batch in batches:                 # one micro-batch per iteration
        loss = engine(batch)              # forward
        engine.backward(loss)             # scale, accumulate, reduce at the accumulation boundary
        engine.step()                     # optimizer + lr scheduler step at the boundary; a no-op otherwise
    engine.save_checkpoint(save_dir, tag, client_state={"iteration": it})

Checkpoint layout and atomicity: checkpoint.py. The engine never reads global args.
"""
import contextlib
import os

import torch
import torch.distributed as dist

import mpu.lora as mpu_lora
import mpu.moe as mpu_moe
import mpu.utils as mpu_utils
from mpu.utils import full_numel, full_shape
from megatron.checkpoint import atomic_io, deepspeed_format, layout as ckpt
from megatron.checkpoint.stage3_module import PartitionedModule
from megatron.timers import Timers

from . import expert_checkpoint, offload, stage3
from .collectives import gather_intervals
from .hybrid_engine import HybridEngine
from .optimizer import ZeroOptimizer
from .throughput import ThroughputTimer
from .zero_init import is_partitioned


def _move_to_device(module, optimizer, device):
    """The client's module onto `device` before anything is partitioned, as DeepSpeed's engine does
    (`self.module.to(self.device)`): Hugging Face and DeepSpeed-Chat models are built on the CPU. A module built
    under zero.Init is already partitioned on the device and is left alone (DeepSpeed's rule). Where the move
    replaces Parameter objects (a device whose tensors cannot share the host's tensor type, e.g. "meta") the client
    optimizer's groups are pointed at the new ones."""
    params = list(module.parameters())
    if any(is_partitioned(p) for p in params):
        return
    module.to(device)
    if optimizer is not None:
        moved = dict(zip(map(id, params), module.parameters()))
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]


class ZeroEngine(torch.nn.Module):
    """`optimizer` None: an inference engine (DeepSpeed's engine built without an optimizer, as DeepSpeed-Chat's
    reference, EMA and reward models): forward only, at stage 0 or 3 (stage 3 partitions every parameter, without
    optimizer state, and gathers per unit as in training); backward() and step() are refused, as DeepSpeed does.

    Names the engine does not define are looked up on the module (DeepSpeed's __getattr__): engine.forward_value,
    engine.gradient_checkpointing_enable() reach the client's model."""

    def __init__(self, module, optimizer, config, ctx, lr_scheduler=None):
        super().__init__()
        self.module = module
        self.config = config
        self.ctx = ctx
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._step_applied = False      # what was_step_applied() reports for the latest step()
        self._device = mpu_utils.get_device()   # looked up at call time: the one device source
        _move_to_device(module, optimizer, self._device)
        dtype = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
        zero_config = config.zero_optimization
        param_order = list(module.parameters())
        param_groups = optimizer.param_groups if optimizer is not None else []
        self.stage3, groups = None, None
        frozen_bytes = 0                  # parameters in no optimizer group (requires_grad False): no state
        if zero_config.stage == 3:
            groups = stage3.partition_parameters(module, param_groups, ctx, zero_config, dtype, self.device)
            self.stage3 = stage3.Stage3Parameters(module, groups, ctx, zero_config, self.device)
            if len(groups) > len(param_groups):   # the stateless parameters' group: gathered, not stepped
                frozen_bytes = groups[-1].parameter_bytes()
                groups = groups[:len(param_groups)]
        else:
            self._broadcast_parameters()
        if dtype is not None:
            module.to(dtype)              # stage 3: the (released) parameters are already in it
        if self.stage3 is None:
            frozen_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
        self.optimizer = None if optimizer is None else \
            self._wrap_optimizer(optimizer, groups, param_order, frozen_bytes)
        if self.stage3 is not None:
            self.stage3.install_hooks()   # after the gradient buckets' hooks: a buffer is released after them
        self.timers = Timers(enabled=config.wall_clock_breakdown, device=self.device)
        throughput = config.timers.throughput
        self.tput_timer = ThroughputTimer(batch_size=config.train_batch_size, enabled=throughput.enabled,
                                          synchronized=throughput.synchronized or config.wall_clock_breakdown,
                                          device=self.device)
        self.hybrid_engine = HybridEngine(self, module, config.hybrid_engine)

    def _wrap_optimizer(self, optimizer, groups, param_order, frozen_bytes):
        """The client's torch optimizer as the partitioned ZeroOptimizer, with the hooks it needs on the module."""
        zero_config = self.config.zero_optimization
        wrapped = ZeroOptimizer(optimizer, self.ctx, zero_config, self.config.fp16, self.config.gradient_clipping,
                                param_order=param_order, groups=groups)
        wrapped.frozen_parameter_bytes = frozen_bytes
        if zero_config.overlap_param_gather:
            wrapped.param_gather.install_hooks(self.module)   # each module's forward waits for its own buckets
        if self.stage3 is not None:
            self.stage3.on_partition_edited = lambda param: wrapped.refresh_masters_from_parameters()
            wrapped.resident_parameter_bytes = self.stage3.persistent.nbytes if self.stage3.persistent else 0
        return wrapped

    def __getattr__(self, name):
        """A name found neither on the engine nor in nn.Module's registries (its own parameters, buffers,
        submodules) is looked up on the client's module, as DeepSpeed's engine does: DeepSpeed-Chat calls
        engine.forward_value(...) and engine.gradient_checkpointing_enable() on its models' engines."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _require_optimizer(self, call):
        """backward() and step() of an inference engine: refused, as DeepSpeed asserts."""
        if self.optimizer is None:
            raise RuntimeError(f"must provide optimizer during init in order to use {call} (DeepSpeed's rule): this "
                               "engine was built without an optimizer, for forward only")

    @property
    def device(self):
        """The compute device (mpu.get_device(), DeepSpeed's local accelerator device), where the module lives."""
        return self._device

    def wait_for_parameters(self):
        """Complete the parameter all-gathers the last step left in flight (overlap_param_gather): call it before
        reading parameters directly between step() and the next forward (forward, state_dict(), checkpoints
        and the optimizer's state wait by themselves). Nothing to wait for without an optimizer."""
        if self.optimizer is not None:
            self.optimizer.param_gather.wait_all()

    def _broadcast_parameters(self):
        """Every data-parallel rank starts from data-parallel rank 0's parameters (an expert parameter under expert
        parallelism: from expert-data-parallel rank 0's, the first rank holding the same experts)."""
        if self.ctx.data_parallel_size == 1:
            return
        experts = self.ctx.for_experts()
        with torch.no_grad():
            for p in self.module.parameters():
                ctx = experts if getattr(p, "expert_parallel", False) else self.ctx
                if ctx.data_parallel_size > 1:
                    dist.broadcast(p.data, group_src=0, group=ctx.data_parallel_group)

    # ---- training --------------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """The module's forward; floating-point tensor inputs are cast to the parameters' dtype."""
        dtype = next(self.module.parameters()).dtype
        cast = (lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x)
        self.tput_timer.start()
        with self.timers("forward"):
            output = self.module(*map(cast, inputs), **{k: cast(v) for k, v in kwargs.items()})
        if self.stage3 is not None:
            self.stage3.end_forward()
            if self.optimizer is None:    # no backward will follow: nothing stays gathered for it
                self.stage3.release_all()
        return output

    def backward(self, loss, output_grad=None, before_reduce=None):
        """Backpropagate the (scaled) loss; reduce gradients at the accumulation boundary (every micro-step
        in stage 2).

        Pipelining (stages 0/1): on a stage before the last, `loss` is the stage's output and `output_grad` the
        gradient the next stage sent, already scaled by the last stage's loss scaling, so it is backpropagated
        as it is (into the flat gradient buffer that `param.grad` views). `before_reduce()` runs after the
        backward and before any reduction: the schedule sends the input gradient to the previous stage there
        (which would otherwise wait on it while this stage waits in a reduction) and sums the tied embedding."""
        self._require_optimizer("backward")
        # MoE layers' aux losses join backward with the factor the loss gets (mpu/moe.py)
        mpu_moe.set_aux_loss_scale(self.optimizer.cur_scale / self.gradient_accumulation_steps())
        with self.timers("backward"):
            if output_grad is None:
                self.optimizer.backward(loss, self.gradient_accumulation_steps())
            else:
                torch.autograd.backward(loss, output_grad)
            if before_reduce is not None:
                before_reduce()
            self.optimizer.finish_micro_step(self.is_gradient_accumulation_boundary())
            if self.stage3 is not None:
                self.stage3.release_all()
        return loss

    @contextlib.contextmanager
    def gathered_for_inference(self):
        """The module's parameters whole for the body (DeepSpeed's Hybrid Engine: generation between training
        steps): stage 3 gathers every one once, bypasses the per-unit hooks (nothing per forward, so the
        data-parallel ranks may run different numbers of no-grad forwards inside) and releases them after; every
        data-parallel rank enters. engine.generate(...) and
        megatron.text_generation.generate_from_training_model(engine, ...) decode in it."""
        self.wait_for_parameters()
        if self.stage3 is None:
            yield
            return
        with self.stage3.gathered_for_inference():
            yield

    def generate(self, input_ids=None, attention_mask=None, max_length=None, max_new_tokens=None, do_sample=None,
                 pad_token_id=None, synced_gpus=False, **kwargs):
        """DeepSpeed's Hybrid Engine call (hybrid_engine.py): the module's generation with every parameter gathered
        once, in eval mode; returns a LongTensor of prompt + new ids, as Hugging Face's `generate`. A Hugging Face
        causal LM runs its own `generate` (these keywords and any other of its own: eos_token_id, top_k, ...; None
        leaves a keyword to its GenerationConfig); megatron's GPT2Model runs
        megatron.text_generation.generate_from_training_model. Every data-parallel rank calls it, with its own
        prompts and lengths if it likes. The training flags and every RNG state are left as found, also when
        do_sample draws (unlike DeepSpeed): training is bitwise what it is without the call. `synced_gpus` is
        passed to Hugging Face's `generate` (its ranks then decode in lockstep); it is not needed here, where
        nothing is gathered per step."""
        return self.hybrid_engine.generate(self, input_ids, attention_mask, max_length, max_new_tokens, do_sample,
                                           pad_token_id, synced_gpus, kwargs)

    def step(self):
        """At the accumulation boundary: optimizer step (skipped on fp16 overflow or when the client set
        optimizer.skip_step), lr scheduler step."""
        self._require_optimizer("step")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            with self.timers("step"):
                applied = self.optimizer.step()
            self._step_applied = applied
            if applied and self.stage3 is not None:
                self.stage3.after_step()
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.skipped_steps += not applied
            self.global_steps += 1
            if self.global_steps % self.config.steps_per_print == 0:
                self._print_progress()
        self.tput_timer.stop(global_step=self.is_gradient_accumulation_boundary())
        self.micro_steps += 1

    def was_step_applied(self):
        """Whether the latest step() updated the parameters (DeepSpeed's name): False between accumulation
        boundaries and on a step skipped for an fp16 overflow."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def _print_progress(self):
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        norm = self.get_global_grad_norm()
        print(f"[zero] step={self.global_steps} skipped={self.skipped_steps} lr={self.get_lr()} "
              f"loss_scale={self.optimizer.cur_scale} grad_norm={norm if norm is None else round(norm, 6)}"
              f"{self.timers.mean_ms_text() if self.timers.enabled else ''}", flush=True)

    # ---- accessors (DeepSpeed names) ---------------------------------------------------------------------
    def train_batch_size(self):
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self):
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self):
        return self.config.zero_optimization.stage

    def set_step_counters(self, global_steps, skipped_steps):
        """Resume the step counters (a checkpoint of this engine or of any other topology): micro steps
        follow from this run's accumulation, which may differ from the saving run's."""
        self.global_steps, self.skipped_steps = int(global_steps), int(skipped_steps)
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()

    def get_lr(self):
        """Each param group's learning rate; [] without an optimizer (DeepSpeed's answer)."""
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self):
        """Norm of the unscaled, unclipped gradients of the last optimizer step (inf on overflow); None before
        the first step and without an optimizer."""
        return self.optimizer.last_grad_norm if self.optimizer is not None else None

    # ---- checkpoints --------------------------------------------------------------------------------------
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

    def load_parameter(self, param, value):
        """Set a module parameter from its whole value on this model-parallel rank (stage 3: its partition)."""
        self.wait_for_parameters()
        with torch.no_grad():
            if self.stage3 is not None:
                self.stage3.write_partition(param, value)
                self.stage3.after_step()
            else:
                param.copy_(value)

    def _load_module_state_dict(self, state_dict, strict):
        if self.stage3 is None:
            self.module.load_state_dict(state_dict, strict=strict)
            return
        if self._load_own_slices(state_dict):
            return
        params = dict(self.module.named_parameters())
        fresh = (self.module.fresh_parameters(state_dict) if hasattr(self.module, "fresh_parameters")   # GPT2Model
                 else mpu_lora.fresh_adapters(params, state_dict))   # a base (LM) checkpoint into a LoRA (reward) model
        params = {name: param for name, param in params.items() if name not in fresh}
        missing = sorted(set(params) - set(state_dict))
        if strict and missing:
            raise ckpt.CheckpointError(f"the checkpoint lacks parameters {missing[:5]}")
        for name, param in params.items():
            if name in state_dict:
                if tuple(state_dict[name].shape) != tuple(full_shape(param)):
                    raise ckpt.CheckpointError(f"{name}: the checkpoint has shape {tuple(state_dict[name].shape)}, "
                                               f"the model {tuple(full_shape(param))}")
                self.load_parameter(param, state_dict[name])

    def _load_own_slices(self, state_dict):
        """A partitioned ZeRO-3 checkpoint of the same groups (names in the same flat order): each group's own
        range copied from the saved slices that overlap it, reading nothing else. False when it does not apply."""
        if not isinstance(state_dict, PartitionedModule):
            return False
        name_of = {id(p): name for name, p in self.module.named_parameters()}
        if state_dict.group_names() != [[name_of[id(p)] for p in g.params] for g in self.stage3.groups]:
            return False
        with torch.no_grad():
            for index, group in enumerate(self.stage3.groups):
                start, end = group.own_range
                group.partition.zero_()
                for lo, hi, weight in state_dict.group_slices(index):
                    a, b = max(start, lo), min(end, hi)
                    if a < b:
                        group.partition[a - start:b - start].copy_(weight[a - lo:b - lo])
        self.stage3.after_step()
        return True

    def _pipeline_rank(self):
        """This rank's stage for the checkpoint names: None at P = 1 (the names without the stage)."""
        return self.ctx.pipeline_parallel_rank if self.ctx.pipeline_parallel_size > 1 else None

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

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Returns (path of the model-states file, client_state), or (None, {}) when there is no checkpoint.
        DeepSpeed's keywords; `load_module_only`: the weights only (the fp32 masters from them; optimizer state,
        lr scheduler and step counters stay as they are).

        Optimizer state saved at any data-parallel size is re-partitioned for this one. A background save in flight
        is finished (published) first. DeepSpeed-written checkpoints load too (megatron.checkpoint.deepspeed_format).
        """
        if load_module_only or self.optimizer is None:   # an inference engine has only weights to load
            load_optimizer_states = load_lr_scheduler_states = False
        atomic_io.finish_pending_save()
        self.wait_for_parameters()      # an in-flight gather would overwrite the loaded weights
        tag = tag if tag is not None else ckpt.read_latest_tag(load_dir)
        if tag is None:
            return None, {}
        directory = atomic_io.readable_directory(os.path.join(load_dir, str(tag)))
        mp_rank, pp_rank = self.ctx.model_parallel_rank, self._pipeline_rank()
        path = deepspeed_format.model_states_path(directory, mp_rank, pp_rank)
        if not os.path.isfile(path) and os.path.isdir(directory):
            found = sorted(n for n in os.listdir(directory) if n.endswith("_model_states.pt"))
            raise ckpt.CheckpointError(f"{path} does not exist: {directory} holds {found or 'no model-states files'} "
                                       f"(this rank: model-parallel rank {mp_rank}, pipeline stage "
                                       f"{self.ctx.pipeline_parallel_rank} of {self.ctx.pipeline_parallel_size})")
        # memory-mapped: stage 3 copies only its partition's pieces of the module; a DeepSpeed-written checkpoint
        # reads as ours (megatron.checkpoint.deepspeed_format)
        state = deepspeed_format.load_model_states(directory, mp_rank, pp_rank)
        if state[ckpt.MODEL_PARALLEL_SIZE] != self.ctx.model_parallel_size:
            raise ckpt.CheckpointError(f"{path} was saved at model-parallel size {state[ckpt.MODEL_PARALLEL_SIZE]}, "
                                       f"this run uses {self.ctx.model_parallel_size}")
        saved_stages = state.get(ckpt.PIPELINE_PARALLEL_SIZE, 1)
        if saved_stages != self.ctx.pipeline_parallel_size:
            raise ckpt.CheckpointError(f"{path} was saved at pipeline-parallel size {saved_stages}, this run uses "
                                       f"{self.ctx.pipeline_parallel_size}")
        module_state = state[ckpt.MODULE]
        if self.ctx.expert_model_parallel_size > 1 and isinstance(module_state, dict):
            module_state = expert_checkpoint.own_experts_only(module_state, self.module)   # it holds every expert
        self._load_module_state_dict(module_state, load_module_strict)
        optim_states = deepspeed_format.load_optim_states(directory, mp_rank, pp_rank, state) \
            if load_optimizer_states else None
        if load_optimizer_states and optim_states is None:
            raise ckpt.CheckpointError(f"{directory} has no optimizer-states files: load it with "
                                       "load_optimizer_states=False (--no-load-optim)")
        if load_optimizer_states:
            # Stage 0 does not partition: every data-parallel rank's file is the same full state, so one is read
            # (reading all would hold data-parallel-size copies of the optimizer state in host memory).
            # Memory-mapped: only this rank's pieces are read.
            if any(self.optimizer.experts) or state.get(ckpt.EXPERT_MODEL_PARALLEL_SIZE, 1) > 1:
                expert_checkpoint.check_optimizer_states_load(state, self.ctx, path)
            self.optimizer.load_partitioned_state_dicts(
                optim_states, expert_states=expert_checkpoint.expert_optim_states(optim_states, self.ctx))
        elif self.optimizer is not None:
            self.optimizer.refresh_masters_from_parameters()
        if load_lr_scheduler_states and self.lr_scheduler is not None and state[ckpt.LR_SCHEDULER] is not None:
            self.lr_scheduler.load_state_dict(state[ckpt.LR_SCHEDULER])
        if not load_module_only:
            self.set_step_counters(state[ckpt.GLOBAL_STEPS], state[ckpt.SKIPPED_STEPS])
        return path, state[ckpt.CLIENT_STATE]
