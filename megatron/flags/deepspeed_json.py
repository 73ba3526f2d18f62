"""Under --deepspeed: the --deepspeed_config JSON parsed (the one time: the zero.Config goes to zero.initialize and
zero.checkpointing.configure) and reconciled with the command line (validate_args, megatron/arguments.py, calls
reconcile_with_deepspeed_config). The JSON is the source of truth for the values both set; a flag given another
value than its default that disagrees with the JSON is an error naming both."""
import os

from megatron import cli, zero

# The JSON's rates set --lr and --muon-lr after validate_args checked the flags: held to the flags' range here (the
# engine's config refuses negative rates, and betas or momentum outside [0, 1), itself; a rate of 0 it allows)
JSON_RANGES = {"lr": "positive", "muon_lr": "positive"}


def reconcile_with_deepspeed_config(args, parser):
    """Parse the JSON config (the one time it is parsed: the `zero.Config` returned goes to zero.initialize and
    zero.checkpointing.configure). Under --deepspeed the JSON is the source of truth for the values it shares
    with the command line (micro batch, global batch / accumulation, clipping, fp16/bf16, lr): the command line
    takes the JSON's values (DeepSpeed's defaults for keys the JSON leaves out), and a flag set to something other
    than its default that disagrees with the JSON is an error naming both values."""
    path = args.deepspeed_config
    if not path:
        parser.error("--deepspeed needs --deepspeed_config PATH (a DeepSpeed-style JSON config)")
    try:
        config = zero.load_config(path, args.data_parallel_size)
    except zero.ConfigError as error:
        parser.error(f"--deepspeed_config: {error}")
    shared = [("batch_size", "--batch-size", config.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu"),
              ("global_batch_size", "--global-batch-size", config.train_batch_size, "train_batch_size"),
              ("clip_grad", "--clip-grad", config.gradient_clipping, "gradient_clipping"),
              ("fp16", "--fp16", config.fp16.enabled, "fp16.enabled"),
              ("bf16", "--bf16", config.bf16.enabled, "bf16.enabled")]
    shared += [("zero_stage", "--zero-stage", config.zero_optimization.stage, "zero_optimization.stage"),
               ("remote_device", "--remote-device", config.zero_optimization.offload_param.device,
                "zero_optimization.offload_param.device")]
    if config.fault_tolerance is not None:   # our own block: the keys it leaves out leave their --ft-* flags alone
        shared += [(f"ft_{name}", f"--ft-{name.replace('_', '-')}", getattr(config.fault_tolerance, name),
                    f"fault_tolerance.{name}") for name in ("replica_groups", "min_replicas", "timeout", "lighthouse",
                                                             "replay_dropped")
                   if getattr(config.fault_tolerance, name) is not None]
    if config.optimizer is not None:
        shared += _optimizer_flags(config.optimizer, parser)
    if config.scheduler is not None:
        _check_scheduler_flags(args, parser, config.scheduler, path)
    for dest, flag, json_value, key in shared:
        wanted = cli.out_of_range(json_value, JSON_RANGES[dest]) if dest in JSON_RANGES else None
        if wanted:     # validate_args checked the flags before the JSON set them
            parser.error(f"{key} is {json_value} in {path}: it must be {wanted} (it sets {flag})")
        value = getattr(args, dest)
        if value != parser.get_default(dest) and value != json_value:
            parser.error(f"{flag} ({value}) disagrees with {key} ({json_value}) in {path}; under --deepspeed the "
                         f"JSON config wins: drop {flag} or make the two agree")
        setattr(args, dest, json_value)
    if config.fp16.enabled:  # Megatron's scaler flags mirror the engine's so logs and checks agree
        args.loss_scale = config.fp16.loss_scale or None
        args.initial_loss_scale = 2.0 ** config.fp16.initial_scale_power
        args.loss_scale_window, args.hysteresis = config.fp16.loss_scale_window, config.fp16.hysteresis
        args.min_scale = config.fp16.min_loss_scale
    # "auto" values are resolved in one place, zero.initialize (from the model's hidden size), which prints them
    return config


# What pretrain_gpt.py's optimizer (torch AdamW, or Muon with its AdamW half) cannot do that a DeepSpeed "Adam" /
# "AdamW" / "Muon" params key can: refused by name at the value that needs it (bias_correction false and Muon's own
# refusals are zero.load_config's). The other keys are honoured through the flags below.
_REFUSED_PARAMS = {
    "adam_w_mode": (False, "Adam with L2 weight decay: pretrain_gpt.py's optimizer is AdamW (decoupled decay, "
                           "DeepSpeed's default); remove it or set it true"),
    "amsgrad": (True, "DeepSpeed's FusedAdam has no AMSGrad either; remove it"),
    "max_grad_norm": (None, "clipping is the JSON's gradient_clipping (--clip-grad); remove it"),
}


def _optimizer_flags(optimizer, parser):
    """(dest, flag, JSON value, JSON key) of the Megatron flags a JSON "optimizer" block sets: its type, lr
    (adam_lr over lr for Muon: --lr is the AdamW half's), weight_decay, betas, eps, torch_adam (torch's kernel:
    --no-fused-adam), and Muon's muon_lr, momentum, ns_method. A key the run cannot honour is refused by name."""
    params, muon = optimizer.params, optimizer.type == "Muon"
    for key, (refused, why) in _REFUSED_PARAMS.items():
        if key in params and (refused is None or params[key] == refused):
            parser.error(f"optimizer.params.{key}: {params[key]!r} is not supported under pretrain_gpt.py "
                         f"--deepspeed ({why})")
    flags = [("optimizer", "--optimizer", "muon" if muon else "adam", "optimizer.type")]
    lr_key = "adam_lr" if muon and "adam_lr" in params else "lr"
    named = [(lr_key, "lr"), ("weight_decay", "weight_decay"), ("eps", "adam_eps")]
    if muon:        # DeepSpeed: the shared lr when muon_lr is absent
        named += [("muon_lr" if "muon_lr" in params else "lr", "muon_lr"), ("momentum", "muon_momentum"),
                  ("ns_method", "muon_ns_method")]
    flags += [(dest, "--" + dest.replace("_", "-"), params[key], f"optimizer.params.{key}")
              for key, dest in named if key in params]
    if "betas" in params:
        flags += [(f"adam_beta{i + 1}", f"--adam-beta{i + 1}", float(params["betas"][i]),
                   f"optimizer.params.betas[{i}]") for i in range(2)]
    if "torch_adam" in params:
        flags.append(("fused_adam", "--no-fused-adam", not params["torch_adam"], "optimizer.params.torch_adam"))
    return flags


# Megatron's schedule flags: a JSON "scheduler" block replaces AnnealingLR (the engine builds the block's schedule,
# megatron/zero/lr_schedules.py), so setting one of these beside it is an error naming both.
_SCHEDULE_FLAGS = ("min_lr", "lr_decay_style", "lr_decay_iters", "warmup", "override_lr_scheduler",
                   "use_checkpoint_lr_scheduler")


def _check_scheduler_flags(args, parser, scheduler, path):
    """A JSON "scheduler" block is the run's schedule (the engine's WarmupLR / WarmupDecayLR honour each of its
    params, training.setup_model_and_optimizer). Megatron's schedule flags set beside it are refused by name, and a
    --lr given must be its peak, warmup_max_lr (DeepSpeed's default 0.001 when the block leaves it out)."""
    for dest in _SCHEDULE_FLAGS:
        if getattr(args, dest) != parser.get_default(dest):
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag} ({getattr(args, dest)}) is a Megatron schedule flag, and {path} has a "
                         f"scheduler block ({scheduler.type}), which is the schedule under --deepspeed: drop {flag} "
                         f"or the block")
    peak = scheduler.params.get("warmup_max_lr", 0.001)
    if args.lr != parser.get_default("lr") and args.lr != peak:
        parser.error(f"--lr ({args.lr}) disagrees with scheduler.params.warmup_max_lr ({peak}) in {path}, the "
                     f"schedule's peak under --deepspeed: drop --lr or make the two agree")
