"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`), as `megatron.zero.checkpointing`.

    from megatron.zero import checkpointing
    checkpointing.configure(mpu, deepspeed_config="ds_config.json", partition_activations=True)
    hidden = checkpointing.checkpoint(run_layers, hidden, mask)  # mpu/transformer.py does this once configured

`checkpoint(fn, *args)` runs `fn` without keeping its activations and recomputes them in backward under the
forward's RNG states (CPU, device and mpu's tracker; there is one tracker, mpu's), so gradients are bitwise those
of a run without checkpointing, dropout included. What it keeps of each floating-point tensor input x (n elements):

    plain                     x itself (no copy)
    partition_activations     1/mp of flat(x) per model-parallel rank; all-gathered before the recompute.
                              The inputs must be replicated across the model-parallel group (the transformer's
                              hidden states are). n = 10, mp = 4: padded to 12, rank r keeps flat[3r:3r+3].
    checkpoint_in_cpu         the kept part lives in host memory (nothing moves on a CPU-only machine)
    contiguous_checkpointing  the kept part is copied into slot k of one buffer preallocated for num_checkpoints
                              calls (per input position); slots are freed by backward, last in first out

Other inputs (masks, ids, non-tensors) are kept as they are. `synchronize` synchronizes the device at both
checkpoint boundaries (a counted no-op on CPU); `profile` times forward, recompute, gather and synchronize.
"""
import dataclasses
import os
import warnings

import torch
import torch.distributed as dist

from mpu.random import get_cuda_rng_tracker as _mpu_rng_tracker
from mpu.random import get_rng_states, model_parallel_cuda_manual_seed as _mpu_manual_seed, set_rng_states
from mpu.utils import get_device

from megatron.timers import Timers

from .collectives import all_gather_into_tensor
from .config import ActivationCheckpointingConfig, Config, ConfigError, load_config, read_config_file

# configure() argument -> key of the JSON `activation_checkpointing` block (DeepSpeed's names for both).
_ARGUMENT_KEYS = {"partition_activations": "partition_activations",
                  "contiguous_checkpointing": "contiguous_memory_optimization",
                  "num_checkpoints": "number_checkpoints",
                  "checkpoint_in_cpu": "cpu_checkpointing",
                  "synchronize": "synchronize_checkpoint_boundary",
                  "profile": "profile"}

_STATE = None  # the one _Checkpointing object configure() builds; None = not configured


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """Turn on zero.checkpointing. `deepspeed_config`: a path, a dict or a parsed `Config`; its
    `activation_checkpointing` block is read, and every argument that is not None overrides its key.
    `mpu_` provides get_model_parallel_{rank,world_size,group}() (None: model-parallel size 1).

    Errors (ConfigError) for what cannot work; a warning, once, for partitioning at model-parallel size 1.
    """
    global _STATE
    config = _read_block(deepspeed_config, mpu_)
    arguments = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                     num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                     profile=profile)
    overrides = {}
    for name, value in arguments.items():
        if value is None:
            continue
        kind = int if name == "num_checkpoints" else bool
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"configure({name}={value!r}): expected {kind.__name__}")
        overrides[_ARGUMENT_KEYS[name]] = value
    config = dataclasses.replace(config, **overrides)
    _STATE = _Checkpointing(config, mpu_)


def is_configured():
    return _STATE is not None


def unconfigure():
    """Back to the state before configure(): mpu/transformer.py uses mpu's own checkpoint again."""
    global _STATE
    _STATE = None


def reset():
    """Free the contiguous buffers and their slots, and zero the profile counters (DeepSpeed: call it when
    forwards ran without their backward, e.g. an evaluation under autograd)."""
    if _STATE is not None:
        _STATE.reset()


def get_cuda_rng_tracker():
    """mpu's tracker: there is one RNG tracker at a time."""
    return _mpu_rng_tracker()


def model_parallel_cuda_manual_seed(seed):
    """mpu's seeding (default generator = seed, tracker 'model-parallel-rng' = seed + 2718 + mp rank)."""
    _mpu_manual_seed(seed)


def get_config():
    """The resolved ActivationCheckpointingConfig (None when not configured)."""
    return None if _STATE is None else _STATE.config


def profile_summary():
    """{name: {"count": calls, "seconds": time (0.0 unless profile is on)}} for forward, recompute, gather,
    synchronize."""
    return {} if _STATE is None else _STATE.timers.summary()


def checkpoint(function, *args):
    """`function(*args)` keeping only `args` (as configured); recomputed in backward with the same RNG states.
    Unconfigured, it checkpoints plainly. Inputs that do not require grad and non-tensor arguments are fine."""
    if not torch.is_grad_enabled():
        return function(*args)
    state = _STATE if _STATE is not None else _Checkpointing(ActivationCheckpointingConfig(), None)
    extra = ()
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # Autograd calls backward only when an input requires grad; this one lets the recompute reach the
        # parameters inside `function` when no input does (e.g. the first layers fed with a constant).
        extra = (torch.empty(0, requires_grad=True),)
    return _CheckpointFunction.apply(function, state, len(args), *args, *extra)


def _read_block(deepspeed_config, mpu_):
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, Config):
        return deepspeed_config.activation_checkpointing
    raw = read_config_file(deepspeed_config) if isinstance(deepspeed_config, (str, os.PathLike)) else deepspeed_config
    if mpu_ is not None:
        data_parallel_size = mpu_.get_data_parallel_world_size()
    else:
        data_parallel_size = dist.get_world_size() if dist.is_initialized() else 1
    return load_config(raw, data_parallel_size=data_parallel_size).activation_checkpointing


class _Checkpointing:
    """Everything configure() decides, plus the contiguous buffers and timers it owns."""

    def __init__(self, config, mpu_):
        _validate(config)
        self.config = config
        self.device = get_device()
        self.mp_size = 1 if mpu_ is None else mpu_.get_model_parallel_world_size()
        self.mp_rank = 0 if mpu_ is None else mpu_.get_model_parallel_rank()
        self.group = None if mpu_ is None else mpu_.get_model_parallel_group()
        if config.partition_activations and self.mp_size == 1:
            warnings.warn("activation_checkpointing.partition_activations has no effect at model-parallel size 1 "
                          "(nothing to partition across); checkpoints are kept whole", stacklevel=3)
        self.partition = config.partition_activations and self.mp_size > 1
        self.storage_device = torch.device("cpu") if config.cpu_checkpointing else self.device
        self.slots = _ContiguousSlots(config.number_checkpoints) if config.contiguous_memory_optimization else None
        self.timers = Timers(enabled=config.profile, device=self.device)

    def reset(self):
        if self.slots is not None:
            self.slots.reset()
        self.timers.reset()

    def synchronize(self):
        if self.config.synchronize_checkpoint_boundary:
            with self.timers("synchronize"):
                _synchronize_device(self.device)

    def pack(self, args, slot):
        """(tensors to save, layout): layout[i] is ("tensor", saved index, shape, requires_grad, padded numel,
        device) or ("object", value); padded numel is None when the saved tensor is the whole input, device is the
        input's own (where unpack puts it back)."""
        saved, layout = [], []
        for position, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                layout.append(("object", arg))
                continue
            kept, padded = self._keep(arg.detach(), position, slot) if arg.is_floating_point() else (arg, None)
            layout.append(("tensor", len(saved), arg.shape, arg.requires_grad, padded, arg.device))
            saved.append(kept)
        return saved, layout

    def _keep(self, tensor, position, slot):
        """The part of `tensor` this rank keeps, where the config says: (kept tensor, padded numel or None)."""
        copy_needed = self.partition or self.slots is not None or tensor.device != self.storage_device
        if not copy_needed:
            return tensor, None
        flat = tensor.reshape(-1)
        numel = flat.numel()
        part = -(-numel // self.mp_size) if self.partition else numel
        start = self.mp_rank * part if self.partition else 0
        piece = flat[start:min(start + part, numel)]  # [part], shorter on the last rank when padded
        if self.slots is not None:
            kept = self.slots.take(slot, position, part, tensor.dtype, self.storage_device)
        else:
            kept = torch.empty(part, dtype=tensor.dtype, device=self.storage_device)
        kept[:piece.numel()].copy_(piece)
        kept[piece.numel():].zero_()
        return kept, part * self.mp_size

    def unpack(self, saved, layout):
        """The inputs again, detached, whole, on the device each came from (a module kept on the host in a CUDA
        run gets host tensors back), requiring grad as they did in forward. Partitions are gathered on the
        communication device (NCCL takes no host tensors) and moved afterwards."""
        inputs = []
        for entry in layout:
            if entry[0] == "object":
                inputs.append(entry[1])
                continue
            _, index, shape, requires_grad, padded, device = entry
            tensor = saved[index]
            if padded is not None:
                if self.partition:
                    whole = torch.empty(padded, dtype=tensor.dtype, device=self.device)
                    with self.timers("gather"):
                        all_gather_into_tensor(whole, tensor.to(self.device), self.group)
                    tensor = whole
                tensor = tensor[:shape.numel()].view(shape).to(device)  # [padded] -> original shape and device
            tensor = tensor.detach()
            tensor.requires_grad_(requires_grad)
            inputs.append(tensor)
        return inputs


class _CheckpointFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, run_function, state, num_args, *args_and_extra):
        args = args_and_extra[:num_args]
        state.synchronize()
        with state.timers("forward"):
            ctx.run_function, ctx.state, ctx.num_extra = run_function, state, len(args_and_extra) - num_args
            ctx.rng_states = get_rng_states()
            with torch.no_grad():
                outputs = run_function(*args)
            ctx.slot = state.slots.acquire() if state.slots is not None else None
            saved, ctx.layout = state.pack(args, ctx.slot)
            ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        state = ctx.state
        state.synchronize()
        inputs = state.unpack(ctx.saved_tensors, ctx.layout)
        with state.timers("recompute"):
            backward_rng_states = get_rng_states()
            set_rng_states(ctx.rng_states)
            try:
                with torch.enable_grad():
                    outputs = ctx.run_function(*inputs)
            finally:
                set_rng_states(backward_rng_states)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        if ctx.slot is not None:
            state.slots.release(ctx.slot)  # the recompute is done: the slot may be overwritten from here on
        grads = tuple(arg.grad if isinstance(arg, torch.Tensor) and arg.requires_grad else None for arg in inputs)
        return (None, None, None) + grads + (None,) * ctx.num_extra


class _ContiguousSlots:
    """For each input position, one buffer of `num_slots` equal slots; call k of a forward uses slot k.

    Slots are separate tensors over the buffer's storage (made with `set_`), not views of it: a view shares
    the buffer's version counter, so writing slot k+1 would make autograd reject slot k as modified in place.
    """

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.buffers = {}  # position -> (buffer, [slot tensors])
        self.in_use = []   # stack of slots; True once released, popped when on top

    def reset(self):
        self.buffers = {}
        self.in_use = []

    def acquire(self):
        if len(self.in_use) == self.num_slots:
            raise RuntimeError(f"contiguous activation checkpointing: more than num_checkpoints={self.num_slots} "
                               "checkpoints before a backward; raise number_checkpoints, or call "
                               "zero.checkpointing.reset() after forwards that had no backward")
        self.in_use.append(False)
        return len(self.in_use) - 1

    def release(self, slot):
        self.in_use[slot] = True
        while self.in_use and self.in_use[-1]:
            self.in_use.pop()

    def take(self, slot, position, numel, dtype, device):
        """Slot `slot` of the buffer for input `position`: a [numel] tensor."""
        buffer, slots = self.buffers.get(position, (None, None))
        fits = buffer is not None and buffer.dtype == dtype and buffer.device == device and slots[0].numel() >= numel
        if not fits:
            if len(self.in_use) > 1:
                raise RuntimeError(f"contiguous activation checkpointing: input {position} ({numel} {dtype} on "
                                   f"{device}) does not fit the slots allocated for this forward; all checkpoints "
                                   "of one forward must have inputs of the same size")
            buffer = torch.empty(self.num_slots * numel, dtype=dtype, device=device)
            storage = buffer.untyped_storage()
            slots = [buffer.new_empty(0).set_(storage, k * numel, (numel,)) for k in range(self.num_slots)]
            self.buffers[position] = (buffer, slots)
        return slots[slot][:numel]


def _synchronize_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _validate(config):
    for key in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                "synchronize_checkpoint_boundary", "profile"):
        if not isinstance(getattr(config, key), bool):
            raise ConfigError(f"activation_checkpointing.{key}: expected bool, got {getattr(config, key)!r}")
    number = config.number_checkpoints
    if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
        raise ConfigError(f"activation_checkpointing.number_checkpoints: expected a positive int, got {number!r}")
    if config.contiguous_memory_optimization and number is None:
        raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (the "
                          "number of checkpoint calls per forward: layers per stage / --recompute-num-layers with "
                          "the uniform method, --recompute-num-layers with block): set it in the JSON block or pass "
                          "configure(num_checkpoints=...)")
