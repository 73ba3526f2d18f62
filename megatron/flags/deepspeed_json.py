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
    if config.optimizer is not None:
        shared += _optimizer_flags(config.optimizer)
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
    ignored = [name for name, block in (("optimizer", config.optimizer), ("scheduler", config.scheduler)) if block]
    if ignored and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {path}: the JSON {' and '.join(ignored)} block(s) are replaced by Megatron's optimizer "
              f"(--optimizer and its flags, set from the JSON's type, lr, muon_lr, adam_lr, momentum, ns_method) and "
              f"--lr-decay-style schedule", flush=True)
    return config


def _optimizer_flags(optimizer):
    """(dest, flag, JSON value, JSON key) of the Megatron flags a JSON "optimizer" block sets: its type, and the lr
    (adam_lr over lr for Muon: --lr is the AdamW half's), muon_lr, momentum, ns_method."""
    params, muon = optimizer.params, optimizer.type == "Muon"
    flags = [("optimizer", "--optimizer", "muon" if muon else "adam", "optimizer.type")]
    lr_key = "adam_lr" if muon and "adam_lr" in params else "lr"
    if lr_key in params:
        flags.append(("lr", "--lr", params[lr_key], f"optimizer.params.{lr_key}"))
    muon_lr = "muon_lr" if "muon_lr" in params else "lr"     # DeepSpeed: the shared lr when muon_lr is absent
    for key, dest in ((muon_lr, "muon_lr"), ("momentum", "muon_momentum"), ("ns_method", "muon_ns_method")):
        if muon and key in params:
            flags.append((dest, "--" + dest.replace("_", "-"), params[key], f"optimizer.params.{key}"))
    return flags
