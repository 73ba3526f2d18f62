"""ZeroEngine: the model wrapper the training loop drives (DeepSpeed's engine API).

    engine, optimizer, _, lr_scheduler = zero.initialize(model=model, optimizer=adamw, config=ds_config, mpu=mpu)
    for batch in batches:                 # one micro-batch per iteration
        loss = engine(batch)              # forward
        engine.backward(loss)             # scale, accumulate, reduce at the accumulation boundary
        engine.step()                     # optimizer + lr scheduler step at the boundary; a no-op otherwise
    engine.save_checkpoint(save_dir, tag, client_state={"iteration": it})

Checkpoint layout and atomicity: checkpoint.py; the engine's saving methods: engine_save.py (a mixin of them).
The engine never reads global args.
"""
import contextlib
import os

import torch
import torch.distributed as dist

import mpu.lora as mpu_lora
import mpu.moe as mpu_moe
import mpu.utils as mpu_utils
from mpu.utils import full_shape
from megatron.checkpoint import atomic_io, deepspeed_format, layout as ckpt
from megatron.checkpoint.optimizer_kind import check_same_optimizer
from megatron.checkpoint.stage3_module import PartitionedModule
from megatron.timers import Timers

from . import expert_checkpoint, stage3
from .engine_save import EngineSaving
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


class ZeroEngine(EngineSaving, torch.nn.Module):
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

    # ---- checkpoints (saving: EngineSaving, engine_save.py) ------------------------------------------------
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
            check_same_optimizer(optim_states[0][ckpt.PARAM_GROUPS], self.optimizer.param_groups, directory)
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
