"""DeepSpeed's JSON config, parsed once into explicit dataclasses.

A user's existing ds_config.json loads unchanged; anything we do not understand is an error that names the key,
the value and, for a misspelt key, the closest valid one:

    >>> load_config({"train_batch_size": 8, "zero_optimisation": {"stage": 2}}, data_parallel_size=2)
    ConfigError: unknown key 'zero_optimisation' in the config; did you mean 'zero_optimization'?

The batch triangle: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp.
Any two of the three determine the third (only one: accumulation defaults to 1); all three must agree:

    train_batch_size (16) != train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (1)
                              x data-parallel size (2) = 8

The JSON is the single source of truth for these values; callers (Megatron's arguments) may check agreement.
"""
import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from megatron.fp16.loss_scaler import LossScalerConfig


class ConfigError(ValueError):
    """A problem with the ZeRO/DeepSpeed JSON config; the message names the key and value."""


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0            # 0 = dynamic loss scaling
    initial_scale_power: int = 16      # dynamic scale starts at 2**initial_scale_power
    loss_scale_window: int = 1000      # clean steps before the scale doubles
    hysteresis: int = 2                # overflows tolerated before the scale halves
    min_loss_scale: float = 1.0

    def loss_scaler_config(self):
        return LossScalerConfig(loss_scale=self.loss_scale, initial_scale_power=self.initial_scale_power,
                                loss_scale_window=self.loss_scale_window, hysteresis=self.hysteresis,
                                min_loss_scale=self.min_loss_scale)


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class OffloadConfig:
    device: str = "none"               # none | cpu ("nvme" is not supported)
    pin_memory: bool = False           # page-locked host buffers (faster copies on a GPU machine)
    nvme_path: Optional[str] = None    # accepted so DeepSpeed files load; nvme itself is refused
    buffer_count: int = 5              # accepted for compatibility (nvme swap buffers)
    buffer_size: int = 100_000_000     # accepted for compatibility
    max_in_cpu: int = 1_000_000_000    # accepted for compatibility
    fast_init: bool = False            # accepted for compatibility
    ratio: float = 1.0                 # accepted for compatibility (partial offload is not done)
    pipeline_read: bool = False        # accepted for compatibility
    pipeline_write: bool = False       # accepted for compatibility

    @property
    def enabled(self):
        return self.device == "cpu"


AUTO = "auto"
# Values "auto" may stand for, resolved from the model's hidden size h as Hugging Face's DeepSpeed integration does.
AUTO_RULES = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
              "stage3_param_persistence_threshold": lambda h: 10 * h}


@dataclass
class ZeroConfig:
    stage: int = 0                     # 0: data parallel; 1: optimizer state partitioned; 2: + gradients; 3: + params
    allgather_partitions: bool = True  # accepted for compatibility: updated slices are always all-gathered
    allgather_bucket_size: int = 500_000_000   # elements per all-gather of updated slices
    overlap_comm: bool = False         # stage 2/3: issue reductions during backward (asynchronous)
    # Stages 1-2: the step returns with the parameter all-gathers in flight; each module's forward waits for its
    # own buckets (param_gather.py). Our key, after Megatron-LM's --overlap-param-gather (DeepSpeed has none for
    # stages 1-2). Off by default: a parameter read directly between step() and the next forward is not waited.
    overlap_param_gather: bool = False
    reduce_scatter: bool = True        # reduce each bucket to its owner (False: all-reduce the bucket)
    reduce_bucket_size: int = 500_000_000      # elements per gradient reduction ("auto": h^2)
    contiguous_gradients: bool = False # stage 2/3: copy gradients into preallocated bucket buffers as they arrive
    cpu_offload: bool = False          # old name of offload_optimizer {"device": "cpu"}
    load_from_fp32_weights: bool = True  # accepted for compatibility (we always restore fp32 slices)
    elastic_checkpoint: bool = True    # accepted for compatibility (our checkpoints always re-partition)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)  # stages 1-3: masters + moments on host
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)      # stage 3: partitions on host
    sub_group_size: int = 1_000_000_000        # fp32 elements per optimizer-step tile
    stage3_prefetch_bucket_size: int = 50_000_000      # elements gathered ahead of use ("auto": 0.9 h^2)
    stage3_param_persistence_threshold: int = 100_000  # parameters this small stay whole ("auto": 10 h)
    stage3_max_live_parameters: int = 1_000_000_000    # at most this many elements gathered (prefetch stops)
    stage3_max_reuse_distance: int = 1_000_000_000     # the forward's last units stay gathered into the backward
    stage3_gather_16bit_weights_on_model_save: bool = False   # save_16bit_model() writes the whole weights
    stage3_gather_fp16_weights_on_model_save: bool = False    # the old name of the previous key
    ignore_unused_parameters: bool = True      # accepted for compatibility (unused parameters get zero gradients)
    round_robin_gradients: bool = False        # accepted for compatibility

    @property
    def gather_16bit_weights_on_model_save(self):
        return self.stage3_gather_16bit_weights_on_model_save or self.stage3_gather_fp16_weights_on_model_save


@dataclass
class ActivationCheckpointingConfig:
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass
class OptimizerConfig:
    type: str = "AdamW"                # Adam | AdamW (case-insensitive, as in DeepSpeed)
    params: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"             # WarmupLR | WarmupDecayLR
    params: dict = field(default_factory=dict)


@dataclass
class Config:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = 1.0     # DeepSpeed 0.19.8's default (GRADIENT_CLIPPING_DEFAULT); 0 = no clipping
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False  # the training_data loader's last incomplete micro-batch (DeepSpeed's key)
    source: Optional[str] = field(default=None, compare=False)   # the file it was read from, if any
    no_effect: dict = field(default_factory=dict, compare=False)  # {key: why it has no effect here}, as given


# Keys DeepSpeed 0.19.8 accepts that change nothing here; accepted so existing files load unchanged, and named in
# one start-up line (Config.no_effect) with the reason.
_ACCEPTED_NO_EFFECT = {"zero_allow_untested_optimizer": bool, "prescale_gradients": bool,
                       "gradient_predivide_factor": float, "memory_breakdown": bool, "dump_state": bool,
                       "zero_force_ds_cpu_optimizer": bool, "communication_data_type": str,
                       "seq_parallel_communication_data_type": str,
                       "graph_harvesting": bool, "disable_allgather": bool}
NO_EFFECT_REASONS = {
    "zero_allow_untested_optimizer": "any torch Adam/AdamW client optimizer is stepped as it is",
    "zero_force_ds_cpu_optimizer": "offload steps any client Adam on the host, DeepSpeedCPUAdam included",
    "communication_data_type": "gradients are reduced in the parameters' dtype (fp32 masters are never sent)",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "prescale_gradients": "gradients are averaged once, after the reduction",
    "gradient_predivide_factor": "gradients are averaged once, after the reduction",
    "memory_breakdown": "memory is reported by --log-jsonl and the start-up estimate",
    "dump_state": "the config is printed by tools/estimate_memory.py",
    "graph_harvesting": "CUDA graphs are not captured",
    "disable_allgather": "stages 1-2 always gather the updated slices",
    "allgather_partitions": "updated slices are always all-gathered",
    "load_from_fp32_weights": "the fp32 slices are always restored",
    "elastic_checkpoint": "checkpoints always re-partition",
    "ignore_unused_parameters": "unused parameters get zero gradients",
    "round_robin_gradients": "gradient partitions are contiguous ranges",
}
# Sections DeepSpeed uses for monitoring and I/O: accepted whole; we log through --log-jsonl / --tensorboard-dir.
_ACCEPTED_SECTIONS = {"flops_profiler": "the log line prints TFLOP/s", "tensorboard": "use --tensorboard-dir",
                      "csv_monitor": "use --log-jsonl", "wandb": "use --log-jsonl", "comet": "use --log-jsonl",
                      "comms_logger": "bench_zero prints the communication table",
                      "aio": "there is no NVMe offload", "checkpoint": "checkpoints are written as docs/ describe",
                      "autotuning": "there is no autotuner"}
# Features DeepSpeed has and we do not: refused by name when enabled (a disabled block loads).
_REFUSED_WHEN_ENABLED = {"amp": "use bf16 or fp16", "elasticity": "launch with a fixed world size",
                         "compression_training": "not supported", "sparse_attention": "not supported",
                         "curriculum_learning": "not supported", "data_efficiency": "not supported",
                         "hybrid_engine": "not supported yet", "pipeline": "use --pipeline-model-parallel-size",
                         "sparse_gradients": "not supported"}
_OPTIMIZER_PARAMS = {"lr": float, "betas": list, "eps": float, "weight_decay": float, "adam_w_mode": bool,
                     "torch_adam": bool, "bias_correction": bool, "amsgrad": bool, "max_grad_norm": float}
_SCHEDULER_PARAMS = {"WarmupLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                  "warmup_type": str, "last_batch_iteration": int},
                     "WarmupDecayLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                       "warmup_type": str, "last_batch_iteration": int, "total_num_steps": int}}
_SECTIONS = {"fp16": FP16Config, "bf16": BF16Config, "bfloat16": BF16Config, "zero_optimization": ZeroConfig,
             "activation_checkpointing": ActivationCheckpointingConfig}
_SCALARS = {"train_batch_size": int, "train_micro_batch_size_per_gpu": int, "gradient_accumulation_steps": int,
            "gradient_clipping": float, "steps_per_print": int, "wall_clock_breakdown": bool,
            "dataloader_drop_last": bool}


def read_config_file(path):
    """The JSON dict at `path`, with errors that name the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None


def load_config(source, data_parallel_size=1):
    """Parse a path or dict into a `Config`, resolving the batch triangle for `data_parallel_size`. A `Config`
    (already parsed, e.g. by Megatron's arguments) is returned as it is, after checking its batch triangle."""
    if isinstance(source, Config):
        resolve_batch_triangle(source.train_batch_size, source.train_micro_batch_size_per_gpu,
                               source.gradient_accumulation_steps, data_parallel_size)
        return source
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    raw = read_config_file(source) if path is not None else source
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
    known = set(_SCALARS) | set(_SECTIONS) | set(_ACCEPTED_NO_EFFECT) | set(_ACCEPTED_SECTIONS) | \
        set(_REFUSED_WHEN_ENABLED) | {"optimizer", "scheduler"}
    _check_keys(raw, known, "the config")
    _refuse_enabled_features(raw)
    values = {}
    for key, kind in {**_SCALARS, **_ACCEPTED_NO_EFFECT}.items():
        if key in raw and raw[key] is not None:
            values[key] = _typed(raw[key], kind, key)
    sections = {}
    for key, cls in _SECTIONS.items():
        if key in raw:
            name = "bf16" if key == "bfloat16" else key
            sections[name] = _section(raw[key], cls, key)
    optimizer = _optimizer(raw["optimizer"]) if raw.get("optimizer") is not None else None
    scheduler = _scheduler(raw["scheduler"]) if raw.get("scheduler") is not None else None
    train, micro, accumulation = resolve_batch_triangle(values.get("train_batch_size"),
                                                        values.get("train_micro_batch_size_per_gpu"),
                                                        values.get("gradient_accumulation_steps"),
                                                        data_parallel_size)
    config = Config(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                    gradient_accumulation_steps=accumulation, optimizer=optimizer, scheduler=scheduler,
                    source=path, **sections, **{k: values[k] for k in ("gradient_clipping", "steps_per_print",
                                                                       "wall_clock_breakdown", "dataloader_drop_last")
                                       if k in values})
    _validate(config)
    config.no_effect = _no_effect_keys(raw, config)
    return config


def _refuse_enabled_features(raw):
    for key, reason in _REFUSED_WHEN_ENABLED.items():
        value = raw.get(key)
        enabled = value.get("enabled", True) if isinstance(value, dict) else bool(value)
        if key in raw and enabled:
            raise ConfigError(f"{key} is enabled in the config, but megatron.zero has no {key} ({reason}): remove "
                              f"the block or set \"enabled\": false")


def _no_effect_keys(raw, config):
    """{key: reason} of what the config sets that has no effect here (printed once at start-up)."""
    keys = {key: NO_EFFECT_REASONS.get(key, "no effect here") for key in _ACCEPTED_NO_EFFECT if key in raw}
    keys.update({key: _ACCEPTED_SECTIONS[key] for key in _ACCEPTED_SECTIONS if key in raw})
    zero_raw = raw.get("zero_optimization")
    if isinstance(zero_raw, dict):
        keys.update({f"zero_optimization.{key}": NO_EFFECT_REASONS[key] for key in zero_raw
                     if key in NO_EFFECT_REASONS})
    return keys


def resolve_batch_triangle(train, micro, accumulation, data_parallel_size):
    """(train_batch_size, micro_batch_per_gpu, accumulation_steps) from any two (or train/micro alone)."""
    dp = data_parallel_size
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accumulation)):
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if train is None and micro is None:
        raise ConfigError("the config must set train_batch_size or train_micro_batch_size_per_gpu "
                          "(train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                          "x data-parallel size)")
    if micro is None:
        accumulation = accumulation or 1
        if train % (accumulation * dp):
            raise ConfigError(f"train_batch_size ({train}) is not divisible by gradient_accumulation_steps "
                              f"({accumulation}) x data-parallel size ({dp}) = {accumulation * dp}")
        micro = train // (accumulation * dp)
    elif train is None:
        accumulation = accumulation or 1
        train = micro * accumulation * dp
    elif accumulation is None:
        if train % (micro * dp):
            raise ConfigError(f"train_batch_size ({train}) is not divisible by train_micro_batch_size_per_gpu "
                              f"({micro}) x data-parallel size ({dp}) = {micro * dp}")
        accumulation = train // (micro * dp)
    if train != micro * accumulation * dp:
        raise ConfigError(f"batch sizes are inconsistent: train_batch_size ({train}) != "
                          f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps "
                          f"({accumulation}) x data-parallel size ({dp}) = {micro * accumulation * dp}")
    return train, micro, accumulation


def _validate(config):
    zero = config.zero_optimization
    if zero.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage: {zero.stage} is not supported (0, 1, 2 or 3)")
    if zero.cpu_offload:
        if zero.offload_optimizer.device == "none":
            zero.offload_optimizer.device = "cpu"
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(zero, key).device
        if device not in ("none", "cpu"):
            raise ConfigError(f"zero_optimization.{key}.device: {device!r} is not supported: use \"cpu\" (host "
                              f"memory) or \"none\"")
    if zero.offload_optimizer.enabled and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (stage is 0): the offloaded "
                          "optimizer steps this rank's partition")
    if zero.offload_param.enabled and zero.stage != 3:
        raise ConfigError(f"zero_optimization.offload_param needs stage 3 (stage is {zero.stage}): only stage 3 "
                          "partitions the parameters; use offload_optimizer for stages 1 and 2")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters"):
        if getattr(zero, key) != AUTO and getattr(zero, key) <= 0:
            raise ConfigError(f"zero_optimization.{key} must be positive, got {getattr(zero, key)}")
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; choose one")
    if config.gradient_clipping < 0:
        raise ConfigError(f"gradient_clipping must be >= 0, got {config.gradient_clipping}")
    fp16 = config.fp16
    if fp16.loss_scale < 0 or fp16.loss_scale_window <= 0 or fp16.hysteresis <= 0 or fp16.min_loss_scale <= 0:
        raise ConfigError(f"fp16: loss_scale ({fp16.loss_scale}) must be >= 0 and loss_scale_window "
                          f"({fp16.loss_scale_window}), hysteresis ({fp16.hysteresis}), min_loss_scale "
                          f"({fp16.min_loss_scale}) positive")
    if config.steps_per_print <= 0:
        raise ConfigError(f"steps_per_print must be positive, got {config.steps_per_print}")


def _check_keys(raw, known, where):
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")


def _typed(value, kind, key):
    """`value` checked against `kind`; ints written as 5e8 are accepted, bools are never numbers."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = not isinstance(value, bool) and (isinstance(value, int) or
                                               (isinstance(value, float) and value.is_integer()))
        value = int(value) if ok else value
    elif kind is float:
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _section(raw, cls, key):
    if cls is ZeroConfig and isinstance(raw, bool):   # old DeepSpeed: "zero_optimization": true == stage 1
        return ZeroConfig(stage=int(raw))
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected an object, got {type(raw).__name__} {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _check_keys(raw, set(fields), f"'{key}'")
    values = {}
    for name, value in raw.items():
        kind = fields[name].type
        if dataclasses.is_dataclass(kind):
            values[name] = _section(value, kind, f"{key}.{name}")
            continue
        if name in AUTO_RULES and value == AUTO:
            values[name] = AUTO
            continue
        if kind in (Optional[int], Optional[str]):
            if value is None:
                values[name] = None
                continue
            kind = int if kind == Optional[int] else str
        values[name] = _typed(value, kind, f"{key}.{name}")
    return cls(**values)


def _optimizer(raw):
    if not isinstance(raw, dict):
        raise ConfigError(f"optimizer: expected an object, got {type(raw).__name__} {raw!r}")
    _check_keys(raw, {"type", "params"}, "'optimizer'")
    kind = _typed(raw.get("type", "AdamW"), str, "optimizer.type")
    names = {"adam": "Adam", "adamw": "AdamW"}
    if kind.lower() not in names:
        raise ConfigError(f"optimizer.type: {kind!r} is not supported (Adam, AdamW); pass a torch optimizer "
                          "object to initialize(optimizer=...) for anything else")
    params = raw.get("params", {}) or {}
    _check_keys(params, set(_OPTIMIZER_PARAMS), "'optimizer.params'")
    params = {k: _typed(v, _OPTIMIZER_PARAMS[k], f"optimizer.params.{k}") for k, v in params.items()}
    if "betas" in params and (len(params["betas"]) != 2 or
                              not all(isinstance(b, (int, float)) for b in params["betas"])):
        raise ConfigError(f"optimizer.params.betas: expected two numbers, got {params['betas']!r}")
    if params.get("bias_correction") is False:
        raise ConfigError("optimizer.params.bias_correction: false is not supported")
    return OptimizerConfig(type=names[kind.lower()], params=params)


def _scheduler(raw):
    if not isinstance(raw, dict):
        raise ConfigError(f"scheduler: expected an object, got {type(raw).__name__} {raw!r}")
    _check_keys(raw, {"type", "params"}, "'scheduler'")
    kind = _typed(raw.get("type"), str, "scheduler.type")
    if kind not in _SCHEDULER_PARAMS:
        close = difflib.get_close_matches(kind, list(_SCHEDULER_PARAMS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"scheduler.type: {kind!r} is not supported (WarmupLR, WarmupDecayLR){hint}")
    spec = _SCHEDULER_PARAMS[kind]
    params = raw.get("params", {}) or {}
    _check_keys(params, set(spec), "'scheduler.params'")
    params = {k: _typed(v, spec[k], f"scheduler.params.{k}") for k, v in params.items()}
    if kind == "WarmupDecayLR" and "total_num_steps" not in params:
        raise ConfigError("scheduler.params.total_num_steps is required for WarmupDecayLR")
    return SchedulerConfig(type=kind, params=params)


def resolve_auto_values(config, hidden_size):
    """Replace "auto" zero_optimization values from the model's hidden size (h^2, 0.9 h^2, 10 h) or, for a model
    without config.hidden_size, by DeepSpeed's defaults (as DeepSpeed 0.19.8 drops "auto" keys there); returns
    {key: value} of what was resolved (empty when nothing was "auto")."""
    zero = config.zero_optimization
    auto = [key for key in AUTO_RULES if getattr(zero, key) == AUTO]
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    resolved = {key: AUTO_RULES[key](hidden_size) if hidden_size else defaults[key] for key in auto}
    for key, value in resolved.items():
        setattr(zero, key, value)
    return resolved
