"""Operations support for the training loop (DESIGN.md section 10): non-finite losses and gradients in
fp32/bf16 (named by iteration and parameter), the --log-jsonl records with the phase timers and memory, and the
model-state memory estimate printed at start-up next to the measured figures after the first step, and the
activation estimate printed beside it."""
import dataclasses
import json
import math
import os

import torch

import mpu
from megatron.cli import UserError
from megatron.guards import memory
from megatron.utils import unwrap_model


# ---- non-finite values in fp32/bf16 ------------------------------------------------------------------------
class NonFiniteError(UserError, RuntimeError):
    """The run stops: a NaN/inf loss or gradient norm in fp32/bf16 (without --skip-nonfinite-steps)."""


class NonFiniteStep(Exception):
    """Raised by train_step before any update is applied (the gradients are dropped): the averaged losses, the
    global gradient norm and the first parameter (by name, 'name (rank r)') whose gradient is non-finite."""

    def __init__(self, losses, grad_norm, parameter):
        super().__init__(parameter)
        self.losses, self.grad_norm, self.parameter = losses, grad_norm, parameter

    def describe(self, iteration):
        values = ", ".join(f"{k}={v:.6g}" for k, v in self.losses.items())
        norm = float("nan") if self.grad_norm is None else float(self.grad_norm)
        return (f"non-finite values at iteration {iteration}: {values}, grad norm={norm:.6g}; first non-finite "
                f"gradient: {self.parameter or 'none (only the loss)'}")


def is_nonfinite(losses, grad_norm):
    """Any of the micro-batches' losses or the global gradient norm is NaN/inf. `grad_norm` is the real norm, inf
    when an optimizer found an inf/nan gradient (FP16_Optimizer, the ZeRO engine): never a finite stand-in."""
    values = [v for d in losses for v in d.values()] + ([] if grad_norm is None else [float(grad_norm)])
    return not all(math.isfinite(v) for v in values)


def first_nonfinite_gradient(module):
    for name, param in module.named_parameters():
        if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
            return name
    return None


def gather_first_name(name):
    """The first rank's (rank order) name: every rank agrees on the failure (the norm and losses are global)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        names = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, name)
        return next((f"{n} (rank {r})" for r, n in enumerate(names) if n is not None), None)
    return None if name is None else f"{name} (rank 0)"


# ---- fp16: a loss scale stuck at its minimum ------------------------------------------------------------------
class LossScaleStuckError(NonFiniteError):
    """fp16: the step overflowed at the minimum loss scale for --max-skipped-steps-at-min-scale iterations in a
    row: the run stops instead of going on with steps that are all skipped."""


class MinLossScaleWatch:
    """Counts consecutive iterations skipped for an fp16 overflow although they ran at the minimum loss scale
    (the scale cannot fall further, so nothing can recover); `limit` 0 never stops. The same on both paths: the
    training loop passes each iteration's skipped flag and the scale after it (FP16_Optimizer.loss_scale or the
    ZeRO engine's optimizer.cur_scale).

        watch = MinLossScaleWatch(min_scale=1.0, limit=3, initial_scale=4.0)   # hysteresis 1: 4 -> 2 -> 1
        # every step overflows: iterations 1 (scale 4) and 2 (scale 2) are ordinary skips; 3, 4, 5 ran at 1
        # -> check() raises at iteration 5 naming iterations 3-5
    """

    def __init__(self, min_scale, limit, initial_scale):
        self.min_scale, self.limit = float(min_scale), int(limit)
        self.scale_used = float(initial_scale)   # the scale the next step runs at (the scale after the last one)
        self.streak = 0

    @classmethod
    def from_args(cls, args, initial_scale):
        return cls(args.min_scale, args.max_skipped_steps_at_min_scale if args.fp16 else 0, initial_scale)

    def check(self, iteration, skipped, scale_after, losses, last_saved_iteration, before_raise=None):
        """Advance one iteration; raise LossScaleStuckError (after calling `before_raise`) at the limit."""
        at_minimum = self.scale_used <= self.min_scale
        self.scale_used = float(scale_after)
        self.streak = self.streak + 1 if skipped and at_minimum else 0
        if self.limit <= 0 or self.streak < self.limit:
            return
        if before_raise is not None:
            before_raise()
        values = ", ".join(f"{k}={v:.6g}" for k, v in losses.items())
        saved = "the one loaded" if last_saved_iteration is None else f"iteration {last_saved_iteration}"
        raise LossScaleStuckError(
            f"fp16 loss scale stuck at its minimum ({self.min_scale:g}): iterations {iteration - self.streak + 1}-"
            f"{iteration} all overflowed at that scale and were skipped ({values}); stopping without saving (the "
            f"latest checkpoint stays {saved}); lower --lr or --min-scale, train in bf16, or raise "
            f"--max-skipped-steps-at-min-scale (0: never stop)")


# ---- --log-jsonl records, phase timers, memory -----------------------------------------------------------------
class LogFileError(UserError, OSError):
    """--log-jsonl names a file that cannot be written (a file where its folder should be, no permission)."""


PHASES = ("forward", "backward", "allreduce", "optimizer", "batch-generator")


def phase_ms(timers, normalizer):
    """Mean ms per iteration of each phase since the last log; None for a phase that did not run on this path
    (under --deepspeed the gradient reduction happens inside the engine's backward: 'allreduce' is None there
    and its time is part of 'backward'). 'batch-generator' is the data wait: reading the micro batches (and
    building their masks), part of 'forward'."""
    result = {}
    for name in PHASES:
        timer = timers.timers.get(name)
        timed = timers.enabled and timer is not None and timer.count > 0
        result[name] = timer.seconds * 1000.0 / normalizer if timed else None
    return result


def memory_now():
    """{'kind': 'cuda_max_allocated' | 'cpu_rss', 'bytes': ...}: torch.cuda.max_memory_allocated on CUDA, the
    process's resident set size on CPU."""
    device = mpu.get_device()
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    try:
        with open("/proc/self/statm") as handle:
            return {"kind": "cpu_rss", "bytes": int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, IndexError):
        import resource
        return {"kind": "cpu_rss", "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _finite_or_none(value):
    return value if value is None or not isinstance(value, float) or math.isfinite(value) else None


def json_value(value):
    """`value` as plain JSON data: dataclasses as their fields, tuples as lists, non-finite floats as None, other
    objects (a torch dtype, a path) as their str()."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite_or_none(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_value(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    return str(value)


PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def header_record(args, iteration):
    """The first --log-jsonl record of a run (rank 0, before the first step; a resumed run appends its own):
    every argument as JSON data and the layout. `iteration` is where this run starts (0, or the loaded one)."""
    zero_stage = args.zero_config.zero_optimization.stage if args.zero_config is not None else None
    return {"type": "header", "iteration": iteration,
            "args": {key: json_value(value) for key, value in sorted(vars(args).items())},
            "layout": {"world_size": args.world_size, "model_parallel_size": args.model_parallel_size,
                       "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                       "data_parallel_size": args.data_parallel_size, "zero_stage": zero_stage,
                       "precision": PRECISION[args.params_dtype]}}


def perplexity(loss):
    """exp(loss), the exponent capped at 20 (an untrained model's loss must not overflow the log line)."""
    return math.exp(min(20.0, loss))


def validation_record(split, at, iteration, losses):
    """A --log-jsonl record of one evaluation (split 'valid' during and at the end of training, 'test' once at the
    end; `at` as the log line says it: 'iteration 100', 'the end of training'): the averaged values and the
    perplexities of the losses among them (is_loss: an accuracy or a score has none), the values the validation
    log line prints."""
    return {"type": "validation", "split": split, "at": at, "iteration": iteration, "losses": dict(losses),
            "ppl": {key: perplexity(value) for key, value in losses.items() if is_loss(key)}}


def is_loss(key):
    """Whether a logged value is a loss, whose exp is a perplexity ('lm loss'); not an accuracy, a score or a
    reward (the reward model's and DPO's other logged values)."""
    return key.endswith("loss")


def write_jsonl_record(path, record):
    """Append one JSON object (non-finite floats as null: strict JSON) and flush; the file's folder is created
    if missing (--log-jsonl newdir/log.jsonl, or under a --save folder the run has not written yet)."""
    clean = {key: ({k: _finite_or_none(v) for k, v in value.items()} if isinstance(value, dict)
                   else _finite_or_none(value)) for key, value in record.items()}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(clean, allow_nan=False) + "\n")
            handle.flush()
    except OSError as error:
        reason = (f"{error.filename} is a file, not a folder" if isinstance(error, FileExistsError)
                  else f"{error.strerror}: {error.filename}")
        raise LogFileError(f"--log-jsonl {path}: cannot write it ({reason}); choose another file") from None


def context_parallel_size(args):
    """--context-parallel-size (1 for an argument namespace built without it)."""
    return getattr(args, "context_parallel_size", 1)


def memory_setting(args):
    zero_config = args.zero_config
    optimizer = 'Megatron optimizer' if zero_config is None else f'ZeRO stage {zero_config.zero_optimization.stage}'
    cp = f", cp {context_parallel_size(args)}" if context_parallel_size(args) > 1 else ""
    return (f"mp rank {mpu.get_model_parallel_rank()}, dp {args.data_parallel_size}{cp}, {optimizer}, "
            f"{args.params_dtype}")


def model_state_estimate(groups, args, module=None):
    """memory.run_model_state_bytes for this rank: `groups` are the optimizer's param groups (memory.StateGroup, or
    plain counts: dense Adam groups) partitioned over the run's data x context parallel ranks (experts over dp / ep),
    with the run's zero.Config (args.zero_config, None on the Megatron path; its "auto" values resolved by
    zero.initialize). `module`: the model, whose small parameters stage 3 keeps whole and whose frozen ones have
    parameters only."""
    parameters = list(module.parameters()) if module is not None else []
    return memory.run_model_state_bytes(groups, args.params_dtype, args.zero_config, args.data_parallel_size,
                                        context_parallel_size(args), getattr(args, "expert_model_parallel_size", 1),
                                        parameter_sizes=[mpu.full_numel(p) for p in parameters],
                                        frozen_elements=sum(mpu.full_numel(p) for p in parameters
                                                            if not p.requires_grad))


def activation_estimate(args):
    """memory.activation_bytes for this rank: its pipeline stage's layers, the micro-batches 1F1B keeps in flight
    there (min(P - stage, micro-batches); interleaved: chunk forwards of one chunk's layers,
    schedules.forwards_in_flight), the run's recompute flags and its layout (device, precision, dropouts,
    zero.checkpointing's partitioned checkpoints). Bytes, and a description of the setting."""
    from megatron.pipeline.schedules import forwards_in_flight
    from megatron.zero import checkpointing
    recompute = mpu.RecomputeConfig(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    stages, stage = args.pipeline_model_parallel_size, mpu.get_pipeline_model_parallel_rank()
    config = checkpointing.get_config()
    partition = config is not None and config.partition_activations and args.model_parallel_size > 1
    layout = memory.ActivationLayout.for_run(mpu.get_device().type, 4 if args.params_dtype == "float32" else 2,
                                             args.attention_dropout, args.hidden_dropout, partition,
                                             args.sequence_parallel, context_parallel_size(args))
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    layers = args.num_layers // stages // chunks           # a model chunk's (the stage's without interleaving)
    in_flight = forwards_in_flight(stages, stage, args.num_micro_batches, chunks)
    held_tokens = args.seq_length // context_parallel_size(args)      # context parallel: this rank's 2 chunks
    total = memory.activation_bytes(layers, held_tokens, args.batch_size, args.hidden_size,
                                    args.num_attention_heads, args.model_parallel_size, recompute, layout, in_flight)
    held = f"{in_flight} in flight, {layers} layers" if chunks == 1 else \
        f"{in_flight} chunk forwards in flight, {layers} layers a chunk"
    tokens = f", {held_tokens} of {args.seq_length} tokens (context parallel)" if held_tokens < args.seq_length else ""
    return total, f"micro batch {args.batch_size} x {held}, recompute {recompute.describe()}{tokens}"


def measured_model_state(model, optimizer, args):
    """After a step: on CUDA torch.cuda.max_memory_allocated; on CPU the sum of the real model-state tensors
    (the engine's partitioned_state_bytes; on the Megatron path params, grads, masters and optimizer state)."""
    if mpu.get_device().type == "cuda":
        return {"cuda_max_allocated": int(torch.cuda.max_memory_allocated(mpu.get_device()))}
    if hasattr(optimizer, "partitioned_state_bytes"):   # the ZeRO engine's optimizer
        return memory.measured_model_state_bytes(optimizer)
    params = list(unwrap_model(model).parameters())
    masters = list(getattr(optimizer, "master_params", []))
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    result = {"parameters": memory.tensors_bytes(params), "gradients": memory.tensors_bytes(p.grad for p in params),
              "master": memory.tensors_bytes(masters) if masters and masters[0] is not params[0] else 0,
              "moments": memory.tensors_bytes(state)}
    if masters and masters[0] is not params[0]:
        result["master_gradients"] = memory.tensors_bytes(m.grad for m in masters)
    result["total"] = sum(result.values())
    return result
