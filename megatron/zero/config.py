"""DeepSpeed's JSON config, parsed once into explicit dataclasses.

A user's existing ds_config.json loads unchanged: every key of DeepSpeed 0.19.8's schema is honoured (a field of
the dataclasses below), accepted and named in `Config.no_effect` with the reason, or refused by name when it
switches on a feature we do not have (the table DEEPSPEED_KEYS). Anything else is an error that names the key,
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

from megatron.cli import UserError
from megatron.fp16.loss_scaler import LossScalerConfig


class ConfigError(UserError, ValueError):
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
    cpu_offload_param: bool = False    # old name of offload_param {"device": "cpu"}
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
    type: str = "AdamW"                # Adam | AdamW | Muon (case-insensitive, as in DeepSpeed)
    params: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"             # WarmupLR | WarmupDecayLR
    params: dict = field(default_factory=dict)


@dataclass
class HybridEngineConfig:
    """DeepSpeed's "hybrid_engine" block (megatron/zero/hybrid_engine.py). engine.generate(...) works whether it is
    on or off; `enabled` also routes the client module's own `generate` through it, as DeepSpeed's Hybrid Engine
    does (DeepSpeed-Chat calls `actor.module.generate(...)`). The other keys are DeepSpeed's inference-kernel
    settings: accepted and typed so DeepSpeed files load, named with no effect (DEEPSPEED_KEYS)."""
    enabled: bool = False
    max_out_tokens: int = 512          # DeepSpeed: its inference workspace, in tokens (must be positive)
    inference_tp_size: int = 1         # DeepSpeed: generation re-sharded over this many tensor-parallel ranks
    release_inference_cache: bool = False   # DeepSpeed: free its inference workspace after each call
    pin_parameters: bool = True        # DeepSpeed at ZeRO-3: gather every layer once per call (else layer by layer)
    tp_gather_partition_size: int = 8  # DeepSpeed: layers gathered at a time when inference_tp_size > 1
    enable_cuda_graph: bool = False    # DeepSpeed: capture decode steps in CUDA graphs


@dataclass
class ThroughputTimerConfig:
    """DeepSpeed's "timers": {"throughput": {...}} block: engine.tput_timer (throughput.py)."""
    enabled: bool = True               # False: the timer neither counts nor times (DeepSpeed's rule)
    # wait for the device at each micro-step's start and stop; DeepSpeed's default is true, a host stall per
    # micro-step: here only when asked (this key or wall_clock_breakdown)
    synchronized: bool = False


@dataclass
class TimersConfig:
    throughput: ThroughputTimerConfig = field(default_factory=ThroughputTimerConfig)


@dataclass
class Config:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)   # engine.generate's block
    timers: TimersConfig = field(default_factory=TimersConfig)
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = 1.0     # DeepSpeed 0.19.8's default (GRADIENT_CLIPPING_DEFAULT); 0 = no clipping
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False  # the training_data loader's last incomplete micro-batch (DeepSpeed's key)
    source: Optional[str] = field(default=None, compare=False)   # the file it was read from, if any
    no_effect: dict = field(default_factory=dict, compare=False)  # {key: why it has no effect here}, as given


# Every DeepSpeed 0.19.8 key that is not a field of the dataclasses above (those are honoured), with what we do:
#   NO_EFFECT: accepted at any value so existing files load unchanged, and named with the reason in one start-up
#     line (Config.no_effect);
#   REFUSED: accepted (and named) while off; refused by name when on, because it would change training in a way
#     we do not implement. `off` is DeepSpeed's default: a scalar is on when it differs; a block is on when any
#     "enabled" inside it is true, or, where `off` is a dict, when one of those switch keys differs.
# Nested keys are dotted ("zero_optimization.memory_efficient_linear"). tests/zero/test_zero_config.py walks
# DeepSpeed's own schema and checks that no key of it is "unknown" here.
NO_EFFECT, REFUSED = "no effect", "refused when enabled"
DEEPSPEED_KEYS = {
    # top level
    "zero_allow_untested_optimizer": (NO_EFFECT, "any torch Adam/AdamW client optimizer is stepped as it is"),
    "zero_force_ds_cpu_optimizer": (NO_EFFECT, "offload steps any client Adam on the host, DeepSpeedCPUAdam "
                                               "included"),
    "communication_data_type": (NO_EFFECT, "gradients are reduced in the parameters' dtype (fp32 masters are "
                                           "never sent)"),
    "seq_parallel_communication_data_type": (NO_EFFECT, "there is no sequence parallelism"),
    "prescale_gradients": (NO_EFFECT, "gradients are averaged once, after the reduction"),
    "gradient_predivide_factor": (NO_EFFECT, "gradients are averaged once, after the reduction"),
    "memory_breakdown": (NO_EFFECT, "memory is reported by --log-jsonl and the start-up estimate"),
    "dump_state": (NO_EFFECT, "the config is printed by tools/estimate_memory.py"),
    "graph_harvesting": (NO_EFFECT, "CUDA graphs are not captured"),
    "disable_allgather": (NO_EFFECT, "stages 1-2 always gather the updated slices"),
    "disable_python_gc": (NO_EFFECT, "Python's garbage collector is left as it is"),
    "log_level": (NO_EFFECT, "megatron.zero prints on rank 0 only"),
    "managed_gradient_accumulation": (NO_EFFECT, "the engine always counts micro-steps to the boundary"),
    "vocabulary_size": (NO_EFFECT, "read by DeepSpeed's pipeline engine only"),
    "use_data_before_expert_parallelism": (NO_EFFECT, "the expert groups come from --expert-model-parallel-size "
                                                      "(mpu/expert_parallel.py)"),
    "flops_profiler": (NO_EFFECT, "the log line prints TFLOP/s"),
    "tensorboard": (NO_EFFECT, "use --tensorboard-dir"),
    "csv_monitor": (NO_EFFECT, "use --log-jsonl"), "wandb": (NO_EFFECT, "use --log-jsonl"),
    "comet": (NO_EFFECT, "use --log-jsonl"),
    "comms_logger": (NO_EFFECT, "bench_zero prints the communication table"),
    "aio": (NO_EFFECT, "there is no NVMe offload"),
    "checkpoint": (NO_EFFECT, "checkpoints are written as docs/ describe"),
    "autotuning": (NO_EFFECT, "there is no autotuner"),
    "optimizer.legacy_fusion": (NO_EFFECT, "the optimizer is torch's"),
    "gradient_allreduce_op": (REFUSED, "gradients are averaged (\"mean\"), never summed", "mean"),
    "amp": (REFUSED, "use bf16 or fp16", None), "elasticity": (REFUSED, "launch with a fixed world size", None),
    "compression_training": (REFUSED, "not supported", None), "sparse_attention": (REFUSED, "not supported", {}),
    "curriculum_learning": (REFUSED, "not supported", None), "data_efficiency": (REFUSED, "not supported", None),
    "progressive_layer_drop": (REFUSED, "not supported", None), "eigenvalue": (REFUSED, "not supported", None),
    "quantize_training": (REFUSED, "not supported", None),
    "pipeline": (REFUSED, "use --pipeline-model-parallel-size", None),
    "sparse_gradients": (REFUSED, "not supported", False),
    "nebula": (REFUSED, "checkpoints are written with torch.save", None),
    "datastates_ckpt": (REFUSED, "checkpoints are written with torch.save", None),
    "torch_autocast": (REFUSED, "use bf16 or fp16", None),
    "compile": (REFUSED, "DeepCompile is not implemented; torch.compile the model yourself", {"deepcompile": False}),
    "weight_quantization": (REFUSED, "weights are never quantized here",
                            {"quantized_initialization": {}, "post_init_quant": {}}),
    "data_types": (REFUSED, "gradients accumulate in the parameters' dtype; fp32 masters are kept by bf16/fp16",
                   {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None,
                    "keep_in_fp32_modules": "auto"}),
    "tensor_parallel": (REFUSED, "use --tensor-model-parallel-size", {"autotp_size": 0}),
    "expert_parallel": (REFUSED, "use --num-experts and --expert-model-parallel-size (docs/models.md)",
                        {"enabled": False}),
    # hybrid_engine ("enabled" is honoured: HybridEngineConfig); DeepSpeed's inference-kernel settings
    "hybrid_engine.max_out_tokens": (NO_EFFECT, "the KV cache is sized per call, for its prompts and new tokens"),
    "hybrid_engine.inference_tp_size": (NO_EFFECT, "generation runs at the training's tensor-parallel layout; the "
                                                   "tokens are the same"),
    "hybrid_engine.release_inference_cache": (NO_EFFECT, "the KV cache is built per call and dropped after it"),
    "hybrid_engine.pin_parameters": (NO_EFFECT, "ZeRO-3 gathers every parameter once per call and releases them "
                                                "after it"),
    "hybrid_engine.tp_gather_partition_size": (NO_EFFECT, "generation is never re-sharded (inference_tp_size)"),
    "hybrid_engine.enable_cuda_graph": (NO_EFFECT, "CUDA graphs are not captured"),
    # fp16 / bf16
    "fp16.auto_cast": (REFUSED, "the model runs in the dtype it is given", False),
    "fp16.consecutive_hysteresis": (REFUSED, "the hysteresis budget is refilled only when the scale grows", False),
    "fp16.fp16_master_weights_and_grads": (REFUSED, "masters are fp32", False),
    "bf16.immediate_grad_update": (NO_EFFECT, "gradients are accumulated into the fp32 masters at the boundary"),
    "bf16.check_grad_overflow": (NO_EFFECT, "bf16 steps are never skipped"),
    "bf16.bf16_master_weights_and_grads": (REFUSED, "masters are fp32", False),
    "bf16.bf16_optimizer_states": (REFUSED, "optimizer states are fp32", False),
    # zero_optimization (the fields of ZeroConfig are honoured; these are accepted as shown)
    "zero_optimization.allgather_partitions": (NO_EFFECT, "updated slices are always all-gathered"),
    "zero_optimization.load_from_fp32_weights": (NO_EFFECT, "the fp32 slices are always restored"),
    "zero_optimization.elastic_checkpoint": (NO_EFFECT, "checkpoints always re-partition"),
    "zero_optimization.ignore_unused_parameters": (NO_EFFECT, "unused parameters get zero gradients"),
    "zero_optimization.round_robin_gradients": (NO_EFFECT, "gradient partitions are contiguous ranges"),
    "zero_optimization.memory_efficient_linear": (NO_EFFECT, "linears are torch's; their backward keeps no extra "
                                                             "copy to save"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (NO_EFFECT, "each bucket is reduced to its owners"),
    "zero_optimization.legacy_stage1": (NO_EFFECT, "there is one stage-1 implementation"),
    "zero_optimization.parameter_alignment": (NO_EFFECT, "partitions are padded as partition.py draws"),
    "zero_optimization.stage3_model_persistence_threshold": (NO_EFFECT, "stage3_param_persistence_threshold "
                                                                        "alone decides what stays whole"),
    "zero_optimization.stage3_module_granularity_threshold": (NO_EFFECT, "parameters are fetched per module"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (NO_EFFECT, "parameters are fetched by "
                                                                            "all-gather"),
    "zero_optimization.stage3_allgather_sequential": (NO_EFFECT, "parameters are fetched by all-gather"),
    "zero_optimization.zero_hpz_partition_size": (NO_EFFECT, "there is one partition group (no ZeRO++ hpZ "
                                                             "secondary copy); the numbers are the same"),
    "zero_optimization.pipeline_loading_checkpoint": (NO_EFFECT, "checkpoints load into the partitions"),
    "zero_optimization.override_module_apply": (NO_EFFECT, "module.apply is never patched"),
    "zero_optimization.log_trace_cache_warnings": (NO_EFFECT, "there is no trace cache"),
    "zero_optimization.enable_sanity_checks": (NO_EFFECT, "the engine's checks always run"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (NO_EFFECT, "Muon's momentum is partitioned like "
                                                               "Adam's moments, always in memory"),
    "zero_optimization.leaf_module": (NO_EFFECT, "parameters are fetched per module"),
    "zero_optimization.cpu_offload_use_pin_memory": (NO_EFFECT, "pin_memory is set in offload_optimizer / "
                                                                "offload_param"),
    "zero_optimization.compute_grad_norm": (REFUSED, "the gradient norm is always computed", True),
    "zero_optimization.zero_quantized_weights": (REFUSED, "weights are gathered unquantized", False),
    "zero_optimization.zero_quantized_nontrainable_weights": (REFUSED, "weights are never quantized", False),
    "zero_optimization.zero_quantized_gradients": (REFUSED, "gradients are reduced unquantized", False),
    "zero_optimization.zenflow": (REFUSED, "ZenFlow is not implemented", None),
    "zero_optimization.mics_shard_size": (REFUSED, "MiCS was removed in DeepSpeed 0.19.8 too", -1),
    "zero_optimization.mics_hierarchical_params_gather": (REFUSED, "MiCS was removed in DeepSpeed 0.19.8 too",
                                                          False),
    "zero_optimization.offload_optimizer.super_offload": (REFUSED, "SuperOffload is not implemented", False),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (NO_EFFECT, "torch chooses its own threads"),
    "zero_optimization.offload_optimizer.ratio": (NO_EFFECT, "the whole partition is offloaded; the numbers are "
                                                             "the same"),
    "zero_optimization.offload_optimizer.fast_init": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.pipeline_read": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.pipeline_write": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.buffer_count": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.nvme_path": (NO_EFFECT, "there is no NVMe offload (device \"nvme\" is "
                                                                 "refused)"),
    "zero_optimization.offload_param.buffer_count": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.buffer_size": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.max_in_cpu": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.nvme_path": (NO_EFFECT, "there is no NVMe offload (device \"nvme\" is "
                                                             "refused)"),
}
# Types checked for top-level no-effect scalars (a wrong type is still an error).
_NO_EFFECT_TYPES = {"zero_allow_untested_optimizer": bool, "prescale_gradients": bool,
                    "gradient_predivide_factor": float, "memory_breakdown": bool, "dump_state": bool,
                    "zero_force_ds_cpu_optimizer": bool, "communication_data_type": str,
                    "seq_parallel_communication_data_type": str, "graph_harvesting": bool,
                    "disable_allgather": bool}
# DeepSpeed's pydantic field names for keys spelt with "stage3_" (it accepts both): the same keys here.
ZERO_ALIASES = {name: "stage3_" + name for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}
_OPTIMIZER_PARAMS = {"lr": float, "betas": list, "eps": float, "weight_decay": float, "adam_w_mode": bool,
                     "torch_adam": bool, "bias_correction": bool, "amsgrad": bool, "max_grad_norm": float}
# DeepSpeed 0.19.8's Muon keys: muon_lr / adam_lr override lr for each half; momentum and ns_method are Muon's
_MUON_PARAMS = {"muon_lr": float, "adam_lr": float, "momentum": float, "ns_method": str, "per_head_muon": bool}
_SCHEDULER_PARAMS = {"WarmupLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                  "warmup_type": str, "last_batch_iteration": int},
                     "WarmupDecayLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                       "warmup_type": str, "last_batch_iteration": int, "total_num_steps": int}}
_SECTIONS = {"fp16": FP16Config, "bf16": BF16Config, "bfloat16": BF16Config, "zero_optimization": ZeroConfig,
             "activation_checkpointing": ActivationCheckpointingConfig, "hybrid_engine": HybridEngineConfig,
             "timers": TimersConfig}
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


def _deepspeed_keys(prefix):
    """{name: entry} of DEEPSPEED_KEYS directly under the dotted `prefix` ("" for the top level)."""
    head = prefix + "." if prefix else ""
    return {key[len(head):]: entry for key, entry in DEEPSPEED_KEYS.items()
            if key.startswith(head) and "." not in key[len(head):]}


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


def _is_on(value, off):
    """Whether a REFUSED key's value switches its feature on (`off` as in DEEPSPEED_KEYS)."""
    if isinstance(value, dict) and off == {}:      # on by being there, unless "enabled": false
        return value.get("enabled", True) is not False
    if isinstance(value, dict) and isinstance(off, dict):      # switch keys, missing ones at DeepSpeed's default
        return any(value.get(switch, default) != default for switch, default in off.items())
    if isinstance(value, dict):        # a block: on when any "enabled" inside it is true
        return value.get("enabled") is True or any(_is_on(v, None) for v in value.values() if isinstance(v, dict))
    return bool(value) if off is None else value != off


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
        if kind in (Optional[int], Optional[str]):
            if value is None:
                values[name] = None
                continue
            kind = int if kind == Optional[int] else str
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
    return OptimizerConfig(type=names[kind.lower()], params=params)


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
