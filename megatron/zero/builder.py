"""The package's entry points: `add_config_arguments(parser)` and `initialize(...)`, as in DeepSpeed.

Which value wins: the JSON config is the only source for the engine (batch sizes, precision, ZeRO stage,
clipping); a client optimizer object overrides the JSON "optimizer" block and a client lr scheduler the JSON
"scheduler" block. Passing both `args.deepspeed_config` and `config=` is an error.
"""
import os

import torch
import torch.distributed as dist

from mpu.utils import get_device, init_distributed

from .config import Config, ConfigError, load_config, resolve_auto_values
from .engine import ZeroEngine
from .optimizer import adam_kernel_options
from .lr_schedules import SCHEDULERS
from .muon import Muon, muon_settings, split_param_groups
from .partition import ParallelContext


def add_config_arguments(parser):
    """Add --deepspeed, --deepspeed_config and --deepspeed_activation_checkpointing; returns the parser."""
    group = parser.add_argument_group("ZeRO", "the integrated ZeRO engine (DeepSpeed-compatible configuration)")
    group.add_argument("--deepspeed", action="store_true", default=False,
                       help="train through the ZeRO engine (megatron.zero)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="path to a DeepSpeed-style JSON config (batch sizes, precision, zero_optimization)")
    group.add_argument("--deepspeed_activation_checkpointing", action="store_true", default=False,
                       help="use megatron.zero.checkpointing for activation checkpointing")
    return parser


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None):
    """Returns (engine, optimizer, training dataloader or None, lr scheduler or None).

    `config`: a dict, a path or a parsed `zero.Config` (`config_params`: DeepSpeed's older name for it);
    otherwise `args.deepspeed_config`. `mpu`: an object with the six
    get_{model,data}_parallel_{rank,group,world_size} getters (None: data parallel over the whole world).
    `dist_init_required=False` trusts the caller's torch.distributed setup; otherwise torch.distributed is
    initialized from torchrun's environment when it is not yet (a single process without it runs alone).
    Neither `optimizer` nor a JSON "optimizer": an engine for forward only, at stage 0 or 3, returned with
    optimizer None and lr scheduler None (DeepSpeed's inference engines: DeepSpeed-Chat's reference, EMA and reward
    models; DeepSpeed 0.19.8 returns its stage-3 parameter coordinator as the optimizer there).
    """
    if model is None:
        raise ValueError("initialize() needs a model")
    if dist_init_required is not False:
        _init_distributed()
    if config is not None and config_params is not None and config is not config_params:
        raise ConfigError("both config= and config_params= were given (config_params is DeepSpeed's older name "
                          "for config): pass one")
    ctx = ParallelContext.from_mpu(mpu)
    cfg = load_config(_config_source(args, config if config is not None else config_params), ctx.sample_parallel_size)
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    resolved = resolve_auto_values(cfg, hidden_size)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _print_start_up_notes(cfg, resolved, hidden_size)
    if optimizer is None and cfg.optimizer is not None:
        optimizer = build_optimizer(cfg.optimizer, model_parameters if model_parameters is not None
                                    else [p for p in model.parameters() if p.requires_grad], model, ctx)
    elif optimizer is None:
        _check_inference_engine(cfg)
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (Adam/AdamW), got {type(optimizer).__name__}")
    engine = ZeroEngine(model, optimizer, cfg, ctx)
    if optimizer is None:        # DeepSpeed configures no lr scheduler without an optimizer
        lr_scheduler = None
    elif lr_scheduler is None and cfg.scheduler is not None:
        lr_scheduler = SCHEDULERS[cfg.scheduler.type](optimizer, **cfg.scheduler.params)
    elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    engine.lr_scheduler = lr_scheduler
    dataloader = _dataloader(training_data, cfg, ctx, collate_fn)
    return engine, engine.optimizer, dataloader, lr_scheduler


def _check_inference_engine(cfg):
    """No optimizer anywhere: an engine for forward only (DeepSpeed-Chat's reference, EMA and reward models). As in
    DeepSpeed 0.19.8 it exists at stage 0 (plain data parallel) and stage 3 (parameters partitioned, no optimizer
    state); stages 1 and 2 partition optimizer state and gradients, so they need an optimizer."""
    stage = cfg.zero_optimization.stage
    if stage in (1, 2):
        raise ConfigError(f"zero stage {stage} requires an optimizer: pass optimizer= or add an \"optimizer\" "
                          "block to the config (an engine for forward only: stage 0 or 3)")


def _print_start_up_notes(cfg, resolved, hidden_size):
    if resolved:
        origin = "the model's hidden size" if hidden_size else \
            "DeepSpeed's defaults (the model has no config.hidden_size)"
        print(f"[zero] \"auto\" resolved from {origin}: {resolved}", flush=True)
    if cfg.no_effect:
        notes = "; ".join(f"{key} ({why})" for key, why in cfg.no_effect.items())
        print(f"[zero] accepted with no effect here: {notes}", flush=True)


def build_optimizer(optimizer_config, params, module=None, ctx=None):
    """torch Adam/AdamW from the JSON block. DeepSpeed's "Adam" is AdamW unless adam_w_mode is false;
    weight_decay defaults to 0 as in DeepSpeed (its FusedAdam's), but to torch's 0.01 with `"torch_adam": true`
    (DeepSpeed then builds torch's AdamW with the JSON's params).

    Kernel: as DeepSpeed defaults to its FusedAdam, torch's fused kernel where it runs on the parameters' device
    (the step runs on the fp32 masters, see `adam_kernel_options`); `"torch_adam": true` keeps torch's default
    kernel (DeepSpeed's meaning: torch's Adam instead of the fused one).
    """
    params = list(params)
    if optimizer_config.type == "Muon":
        return _build_muon(optimizer_config.params, params, module, ctx)
    p = dict(optimizer_config.params)
    adam_w_mode = p.pop("adam_w_mode", True) or optimizer_config.type == "AdamW"
    torch_adam = p.pop("torch_adam", False)
    for ignored in ("bias_correction", "max_grad_norm"):   # use gradient_clipping for clipping
        p.pop(ignored, None)
    first = _first_tensor(params)
    if not torch_adam and first is not None:
        p.update(adam_kernel_options(first.device))
    # DeepSpeed's FusedAdam defaults weight_decay to 0; with torch_adam it builds torch's AdamW, whose default is 0.01
    kwargs = {"lr": p.pop("lr", 1e-3), **({} if torch_adam else {"weight_decay": p.pop("weight_decay", 0.0)}), **p}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kwargs)


def _build_muon(config_params, params, module, ctx):
    """DeepSpeed's {"type": "Muon"}: the model's hidden matrices to Muon, the rest to AdamW (muon.py)."""
    if module is None:
        raise ConfigError("optimizer Muon needs the model (initialize(model=...)) to split its parameters")
    muon, adam = muon_settings(config_params)
    groups = split_param_groups(module, params, muon, adam)
    first = _first_tensor(params)
    kernel = adam_kernel_options(first.device) if first is not None else {}
    model_parallel = (ctx.model_parallel_group, ctx.model_parallel_rank, ctx.model_parallel_size) if ctx else None
    return Muon(groups, model_parallel=model_parallel, adam_kernel=kernel)


def _first_tensor(params):
    """The first parameter of a list of parameters or of param-group dicts (None when there is none)."""
    for item in params:
        for tensor in (item["params"] if isinstance(item, dict) else [item]):
            return tensor
    return None


def _config_source(args, config):
    """`config`, or the path in args.deepspeed_config; both only when `config` was parsed from that file."""
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    parsed_from_path = isinstance(config, Config) and config.source is not None and path is not None and \
        os.path.abspath(config.source) == os.path.abspath(path)
    if path is not None and config is not None and not parsed_from_path:
        raise ConfigError(f"both args.deepspeed_config ({path!r}) and config= were given; pass one")
    if path is None and config is None:
        raise ConfigError("no config: pass config= (a dict or a path) or args.deepspeed_config")
    return config if config is not None else path


def _init_distributed():
    """DeepSpeed's `dist_init_required`: start torch.distributed from torchrun's environment, the device set first
    (mpu.init_distributed: on CUDA every rank would otherwise use cuda:0 for NCCL and the object collectives)."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    init_distributed()


def _dataloader(training_data, config, ctx, collate_fn):
    """DeepSpeed's loader for `training_data`: in a distributed run a DistributedSampler over the data-parallel
    group (shuffled, seed 0), else a RandomSampler; micro batches of train_micro_batch_size_per_gpu, the last
    incomplete one kept unless dataloader_drop_last."""
    if training_data is None:
        return None
    if dist.is_available() and dist.is_initialized():
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=ctx.sample_parallel_size,
                                                      rank=ctx.sample_parallel_rank)
    else:
        sampler = torch.utils.data.RandomSampler(training_data)
    return torch.utils.data.DataLoader(training_data, batch_size=config.train_micro_batch_size_per_gpu,
                                       pin_memory=get_device().type == "cuda",   # DeepSpeed pins on accelerators
                                       sampler=sampler, collate_fn=collate_fn, drop_last=config.dataloader_drop_last)
