"""The schema of DeepSpeed's JSON config as dataclasses: every field is a key we honour, with DeepSpeed's default.

`Config` is what config.load_config returns (the parsing and the checks are config.py's; the DeepSpeed keys that
are accepted without effect or refused are config_keys.py's). Every name here is also importable from
megatron.zero.config.
"""
from dataclasses import dataclass, field
from typing import Optional

from megatron.fp16.loss_scaler import LossScalerConfig



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
    # Our key (DeepSpeed has none: it gathers at dp 1 too). True: a group partitioned over one rank (dp 1; an expert
    # group at expert-data-parallel size 1) and not offloaded keeps its parameters whole, as views of its partition:
    # no gather, release or per-unit hook (stage3.py). False: gathered and released per unit as at dp > 1.
    stage3_resident_at_dp1: bool = True
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
class FaultToleranceConfig:
    """Our own block (DeepSpeed has none): fault-tolerant replica groups on torchft (megatron/trainer/
    fault_tolerance.py; docs/operations.md). Each key given sets the --ft-* flag of the same name (a key left out
    leaves its flag alone); the group id differs per job, so it stays on the command line (--ft-group-id)."""
    replica_groups: Optional[int] = None   # R, the number of replica groups (--ft-replica-groups); 1: off
    min_replicas: Optional[int] = None     # a step commits only with this many groups in the quorum
    timeout: Optional[int] = None          # seconds: gradient exchange, should_commit, quorum, heal (--ft-timeout)
    lighthouse: Optional[str] = None       # http://HOST:PORT of torchft_lighthouse (--ft-lighthouse)
    replay_dropped: Optional[bool] = None  # train on a dropped group's samples later (--ft-replay-dropped)


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
    fault_tolerance: Optional[FaultToleranceConfig] = None   # absent: the --ft-* flags decide
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = 1.0     # DeepSpeed 0.19.8's default (GRADIENT_CLIPPING_DEFAULT); 0 = no clipping
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False  # the training_data loader's last incomplete micro-batch (DeepSpeed's key)
    source: Optional[str] = field(default=None, compare=False)   # the file it was read from, if any
    no_effect: dict = field(default_factory=dict, compare=False)  # {key: why it has no effect here}, as given
