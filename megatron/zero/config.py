"""DeepSpeed's JSON config, parsed once into explicit dataclasses.

A user's existing ds_config.json loads unchanged: every key of DeepSpeed 0.19.8's schema is honoured (a field of
the dataclasses of config_schema.py), accepted and named in `Config.no_effect` with the reason, or refused by name
when it switches on a feature we do not have (the table DEEPSPEED_KEYS, config_keys.py). Anything else is an error
that names the key, the value and, for a misspelt key, the closest valid one:

    >>> load_config({"train_batch_size": 8, "zero_optimisation": {"stage": 2}}, data_parallel_size=2)
    ConfigError: unknown key 'zero_optimisation' in the config; did you mean 'zero_optimization'?

The batch triangle: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp.
Any two of the three determine the third (only one: accumulation defaults to 1); all three must agree:

    train_batch_size (16) != train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (1)
                              x data-parallel size (2) = 8

The JSON is the single source of truth for these values; callers (Megatron's arguments) may check agreement.
This module holds ConfigError, the parsing and the checks; the schema's and the tables' names are importable from
it as before the split.
"""
import dataclasses
import difflib
import json
import os
from typing import Optional

from megatron.cli import UserError, out_of_range

# The schema (config_schema.py) and the key tables (config_keys.py), defined here before the split: importable
# from here as they were.
from .config_keys import (DEEPSPEED_KEYS, NO_EFFECT, REFUSED, ZERO_ALIASES, _MUON_PARAMS,  # noqa: F401
                          _NO_EFFECT_TYPES, _OPTIMIZER_PARAMS, _SCHEDULER_PARAMS, _deepspeed_keys, _is_on)
from .config_schema import (AUTO, AUTO_RULES, ActivationCheckpointingConfig, BF16Config, Config,  # noqa: F401
                            FaultToleranceConfig, FP16Config, HybridEngineConfig, OffloadConfig, OptimizerConfig, SchedulerConfig,
                            ThroughputTimerConfig, TimersConfig, ZeroConfig)


class ConfigError(UserError, ValueError):
    """A problem with the ZeRO/DeepSpeed JSON config; the message names the key and value."""


_SECTIONS = {"fp16": FP16Config, "bf16": BF16Config, "bfloat16": BF16Config, "zero_optimization": ZeroConfig,
             "activation_checkpointing": ActivationCheckpointingConfig, "hybrid_engine": HybridEngineConfig,
             "timers": TimersConfig, "fault_tolerance": FaultToleranceConfig}
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
    known = set(_SCALARS) | set(_SECTIONS) | set(_deepspeed_keys("")) | {"optimizer", "scheduler"}
    _check_keys(raw, known, "the config")
    no_effect = _accept_deepspeed_keys(raw, "", {})
    values = {}
    for key, kind in {**_SCALARS, **_NO_EFFECT_TYPES}.items():
        if key in raw and raw[key] is not None:
            values[key] = _typed(raw[key], kind, key)
    sections = {}
    for key, cls in _SECTIONS.items():
        if key in raw:
            name = "bf16" if key == "bfloat16" else key
            sections[name] = _section(raw[key], cls, key, no_effect)
    optimizer = _optimizer(raw["optimizer"], no_effect) if raw.get("optimizer") is not None else None
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
    _validate(config, no_effect)
    config.no_effect = no_effect
    return config


def _accept_deepspeed_keys(raw, prefix, no_effect):
    """Refuse what `raw` (the block at `prefix`) switches on of the REFUSED keys; name the rest in `no_effect`."""
    for name, (what, why, *off) in _deepspeed_keys(prefix).items():
        if name not in raw:
            continue
        key, value = f"{prefix}.{name}" if prefix else name, raw[name]
        if what == REFUSED and _is_on(value, off[0]):
            if off[0] is None or off[0] == {}:
                raise ConfigError(f"{key} is enabled in the config, but megatron.zero has no {key} ({why}): "
                                  f"remove the block or set \"enabled\": false")
            if isinstance(off[0], dict):
                raise ConfigError(f"{key}: {value!r} switches on what megatron.zero does not have ({why}): remove "
                                  f"it or leave {off[0]!r} at DeepSpeed's defaults")
            raise ConfigError(f"{key}: {value!r} is not supported ({why}): remove it or set DeepSpeed's default "
                              f"{off[0]!r}")
        no_effect[key] = why if what == NO_EFFECT else f"off; refused when on: {why}"
    return no_effect


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


def _validate(config, no_effect):
    """Refuse values the engine cannot run; `no_effect` gets the ones accepted without effect (as DeepSpeed)."""
    zero = config.zero_optimization
    if zero.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage: {zero.stage} is not supported (0, 1, 2 or 3)")
    if zero.cpu_offload and zero.offload_optimizer.device == "none":
        zero.offload_optimizer.device = "cpu"
    if zero.cpu_offload_param and zero.offload_param.device == "none":
        zero.offload_param.device = "cpu"
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(zero, key).device
        if device not in ("none", "cpu"):
            raise ConfigError(f"zero_optimization.{key}.device: {device!r} is not supported: use \"cpu\" (host "
                              f"memory) or \"none\"")
    if zero.offload_optimizer.enabled and config.optimizer is not None and config.optimizer.type == "Muon":
        raise ConfigError("optimizer Muon with zero_optimization.offload_optimizer is not supported: remove the "
                          "offload block, or use AdamW")
    if zero.offload_optimizer.enabled and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (stage is 0): the offloaded "
                          "optimizer steps this rank's partition")
    if zero.offload_param.enabled and zero.stage != 3:
        # DeepSpeed reads offload_param at stage 3 only and ignores it below (DeepSpeed-Chat's --offload sets it
        # for its ZeRO-2 critic): switched off here, so nothing downstream counts it, and named
        no_effect["zero_optimization.offload_param"] = \
            f"stage {zero.stage}: only stage 3 partitions the parameters (offload_optimizer offloads at stages 1-3)"
        zero.offload_param = OffloadConfig()
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
    hybrid = config.hybrid_engine
    for key in ("max_out_tokens", "inference_tp_size", "tp_gather_partition_size"):   # DeepSpeed's checks too
        if getattr(hybrid, key) <= 0:
            raise ConfigError(f"hybrid_engine.{key} must be positive, got {getattr(hybrid, key)}")


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


def _section(raw, cls, key, no_effect):
    if cls is ZeroConfig and isinstance(raw, bool):   # old DeepSpeed: "zero_optimization": true == stage 1
        return ZeroConfig(stage=int(raw))
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected an object, got {type(raw).__name__} {raw!r}")
    if cls is ZeroConfig:
        raw = {ZERO_ALIASES.get(name, name): value for name, value in raw.items()}
    table_key = "bf16" if key == "bfloat16" else key
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _check_keys(raw, set(fields) | set(_deepspeed_keys(table_key)), f"'{key}'")
    _accept_deepspeed_keys(raw, table_key, no_effect)
    values = {}
    for name, value in raw.items():
        if name not in fields or value is None:    # null: DeepSpeed's default (overlap_comm, offload_*, ...)
            continue
        kind = fields[name].type
        if dataclasses.is_dataclass(kind):
            values[name] = _section(value, kind, f"{key}.{name}", no_effect)
            continue
        if name in AUTO_RULES and value == AUTO:
            values[name] = AUTO
            continue
        if kind in (Optional[int], Optional[str], Optional[bool]):
            kind = {Optional[int]: int, Optional[str]: str, Optional[bool]: bool}[kind]
        values[name] = _typed(value, kind, f"{key}.{name}")
    return cls(**values)


def _optimizer(raw, no_effect):
    if not isinstance(raw, dict):
        raise ConfigError(f"optimizer: expected an object, got {type(raw).__name__} {raw!r}")
    _check_keys(raw, {"type", "params"} | set(_deepspeed_keys("optimizer")), "'optimizer'")
    _accept_deepspeed_keys(raw, "optimizer", no_effect)
    kind = _typed(raw.get("type", "AdamW"), str, "optimizer.type")
    names = {"adam": "Adam", "adamw": "AdamW", "muon": "Muon"}
    if kind.lower() not in names:
        raise ConfigError(f"optimizer.type: {kind!r} is not supported (Adam, AdamW, Muon); pass a torch optimizer "
                          "object to initialize(optimizer=...) for anything else")
    accepted = {**_OPTIMIZER_PARAMS, **(_MUON_PARAMS if kind.lower() == "muon" else {})}
    params = raw.get("params", {}) or {}
    _check_keys(params, set(accepted), "'optimizer.params'")
    params = {k: _typed(v, accepted[k], f"optimizer.params.{k}") for k, v in params.items()}
    if kind.lower() == "muon":
        _check_muon(params)
    if "betas" in params and (len(params["betas"]) != 2 or
                              not all(isinstance(b, (int, float)) for b in params["betas"])):
        raise ConfigError(f"optimizer.params.betas: expected two numbers, got {params['betas']!r}")
    if params.get("bias_correction") is False:
        raise ConfigError("optimizer.params.bias_correction: false is not supported")
    _check_param_ranges(params)
    return OptimizerConfig(type=names[kind.lower()], params=params)


# torch's rules for its optimizers' numbers, checked at parse time (one line, not a traceback at build); an lr of 0
# is allowed, as torch allows it (a JSON scheduler sets the lr)
_PARAM_RANGES = {"lr": "non_negative", "muon_lr": "non_negative", "adam_lr": "non_negative", "eps": "non_negative",
                 "weight_decay": "non_negative", "momentum": "fraction"}


def _check_param_ranges(params):
    checks = [(f"optimizer.params.{key}", params[key], kind) for key, kind in _PARAM_RANGES.items() if key in params]
    checks += [(f"optimizer.params.betas[{i}]", beta, "fraction") for i, beta in enumerate(params.get("betas", ()))]
    for name, value, kind in checks:
        wanted = out_of_range(value, kind)
        if wanted:
            raise ConfigError(f"{name} is {value}: it must be {wanted}")


def _check_muon(params):
    if params.get("per_head_muon"):
        raise ConfigError("optimizer.params.per_head_muon: true is not supported (each matrix is orthogonalized "
                          "whole); remove it")
    if params.get("ns_method", "standard") not in ("standard", "gram"):
        raise ConfigError(f"optimizer.params.ns_method: {params['ns_method']!r} is not 'standard' or 'gram'")
    for key in ("amsgrad", "torch_adam"):
        if params.get(key):
            raise ConfigError(f"optimizer.params.{key}: true is not supported with Muon (its AdamW half is torch's "
                              "AdamW); remove it")
    if params.get("adam_w_mode") is False:
        raise ConfigError("optimizer.params.adam_w_mode: false is not supported with Muon (its Adam half decays "
                          "weights decoupled, AdamW); remove it")


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
