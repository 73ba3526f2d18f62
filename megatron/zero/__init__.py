"""The integrated ZeRO engine with DeepSpeed's API (read `deepspeed` as `zero`).

    parser = zero.add_config_arguments(parser)
    engine, optimizer, _, lr_scheduler = zero.initialize(model=model, optimizer=adamw, args=args,
                                                         lr_scheduler=lr_scheduler, mpu=mpu)
    loss = engine(batch); engine.backward(loss); engine.step()
    engine.save_checkpoint(save_dir, tag, client_state={...}); engine.load_checkpoint(load_dir)

Stages 0 (data parallel), 1 (optimizer state partitioned), 2 (gradients too) and 3 (parameters too, gathered per
unit: stage3.py; build with `zero.Init`, read with `zero.GatheredParameters`); offload of the optimizer (stages 1-3)
and of the parameters (stage 3) to host memory; fp32, fp16, bf16.
`engine.generate(...)` is DeepSpeed's Hybrid Engine (hybrid_engine.py; `register_generator` lets a model without
Hugging Face's `generate` take part). `zero.checkpointing` is activation checkpointing. Checkpoint file names and
keys: megatron.checkpoint.layout.

Code outside this package imports only what this file exports (tests/test_layout.py pins it); the loss scaler it
shares with the Megatron fp16 path lives in megatron.fp16, whole parameter sizes in mpu (full_numel/full_shape).
"""
import sys

from megatron.fp16.loss_scaler import LossScaler, LossScalerConfig

from .bucketing import MAX_IN_FLIGHT
from .builder import adam_kernel_options, add_config_arguments, build_optimizer, initialize
from .config import Config, ConfigError, load_config
from .engine import ZeroEngine
from .hybrid_engine import register_generator
from .muon import Muon, MuonError, muon_settings, split_param_groups
from .optimizer import ZeroOptimizer
from .param_status import ZeroParamStatus
from .partition import ALIGNMENT
from .replica_state import load_replica_state_dict, replica_state_dict
from .zero_init import register_external_parameter
from .zero_init import GatheredParameters, Init

from . import checkpointing, offload

# DeepSpeed spells these deepspeed.zero.Init / .GatheredParameters / .register_external_parameter: with this package
# imported as `deepspeed`, `deepspeed.zero` is the package itself.
zero = sys.modules[__name__]

__all__ = ["add_config_arguments", "initialize", "build_optimizer", "Config", "ConfigError", "load_config",
           "ZeroEngine", "ZeroOptimizer", "LossScaler", "LossScalerConfig", "checkpointing", "Init",
           "GatheredParameters", "register_external_parameter", "ZeroParamStatus", "adam_kernel_options",
           "ALIGNMENT", "MAX_IN_FLIGHT", "zero", "offload", "register_generator", "as_deepspeed", "Muon",
           "MuonError", "muon_settings", "split_param_groups", "replica_state_dict", "load_replica_state_dict"]


def __getattr__(name):
    """`as_deepspeed` (the `deepspeed` alias a client installs) is imported on first use, not with the engine."""
    if name == "as_deepspeed":
        import importlib
        return importlib.import_module(f"{__name__}.as_deepspeed")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
