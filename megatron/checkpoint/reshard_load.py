"""Loading a checkpoint of any topology or path into this rank's model, optimizer and lr scheduler, from the full
tensors megatron.checkpoint.reshard reads (megatron.checkpoint.loading calls it whenever the saving path or
model-parallel size differs from this run's)."""
import torch

import mpu
from megatron import print_rank_0, unwrap_model
from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.optimizer_kind import check_other_optimizer
from megatron.checkpoint.reshard import partitioning
from megatron.checkpoint.rng import set_rng_state
from megatron.checkpoint.saving import is_zero_engine, optimizer_param_names
from megatron.checkpoint.stage3_module import tensor_shape
from megatron.train_state import TrainState


def check_same_model(saved, config):
    """The saved model and `config` (a GPT2ModelConfig) differ only in how they are split."""
    ours = {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, **ckpt.architecture_record(config)}
    if saved.real_vocab_size is not None and config.real_vocab_size is not None:
        ours["vocab_size"] = config.real_vocab_size
    ckpt.check_model_shape(saved.model_shape, ours, list(ours), saved.directory, strict=False)


def check_lora_adapters(saved, config):
    """A checkpoint holding LoRA adapters loads only into a model with the same ones (--lora-rank, --lora-alpha,
    --lora-targets as saved): into one without them the adapters would be dropped and the base model run. (A model
    with adapters loads a base checkpoint: fresh adapters, the start of LoRA fine-tuning.)"""
    weights = saved.weights_of[0]
    adapters = [name for name in weights if mpu.is_lora_parameter(name)]
    if not adapters:
        return
    targets = [t for t, linear in mpu.LORA_TARGETS.items() if any(f".{linear}.lora_" in n for n in adapters)]
    rank = tensor_shape(weights, next(name for name in adapters if name.endswith(".lora_A")))[0]
    alpha = saved.model_shape.get("lora_alpha")    # not recorded by a resized copy (tools/checkpoint_util.py)
    ours = getattr(config, "lora", None)
    if ours is not None and (ours.rank, set(ours.targets)) == (rank, set(targets)) and alpha in (None, ours.alpha):
        return
    wanted = f"--lora-rank {rank} --lora-alpha {'(its training value)' if alpha is None else format(alpha, 'g')}" + \
        ("" if targets == list(mpu.LORA_TARGETS) else f" --lora-targets {','.join(targets)}")
    has = "has none (it would run the base model alone)" if ours is None else \
        f"has --lora-rank {ours.rank} --lora-alpha {ours.alpha:g} --lora-targets {','.join(ours.targets)}"
    raise ckpt.CheckpointError(f"{saved.directory} holds LoRA adapters ({wanted}), this run {has}: pass {wanted}")


def load_resharded(model, optimizer, lr_scheduler, saved, options, fresh=False):
    """Load `saved` (any layout, any topology) into this rank's `model` and (unless fresh / no_load_optim) its
    optimizer, lr scheduler and loss scaler. Returns the TrainState to continue from. RNG states are restored
    only at the saving model-parallel size (dropout streams are per model-parallel rank anyway)."""
    module = unwrap_model(model)
    check_same_model(saved, module.config)
    world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    target = (f"mp{world} x dp{mpu.get_data_parallel_world_size()} "
              + (f"(zero-{model.zero_optimization_stage()})" if is_zero_engine(model) else "(megatron)"))
    print_rank_0(f"resharding checkpoint saved at {saved.describe()} for {target}")

    params = dict(module.named_parameters())
    fresh_adapters = module.fresh_parameters(saved.weights_of[0])   # a base (LM) checkpoint into a LoRA (reward) model
    params = {name: param for name, param in params.items() if name not in fresh_adapters}

    def shard(name, kind):
        """This rank's piece of `name`'s full tensor: the parameter's dtype for weights, fp32 otherwise."""
        like = params[name]
        padded_rows = mpu.full_shape(like)[0] * world if partitioning(name)[2] else None
        piece = saved.shard(name, kind, world, rank, padded_rows)
        return None if piece is None else piece.to(like.dtype if kind == "weight" else torch.float32)

    with torch.no_grad():
        for name, param in params.items():
            if is_zero_engine(model):
                model.load_parameter(param, shard(name, "weight"))   # stage 3: into its partition
            else:
                param.copy_(shard(name, "weight"))
    load_optimizer = not (fresh or options.no_load_optim)
    if load_optimizer and fresh_adapters:
        raise ckpt.CheckpointError(f"{saved.directory} has no LoRA adapters (a base model): load it with --finetune "
                                   "(fresh adapters and optimizer)")
    experts = saved.files[0].get(ckpt.EXPERT_MODEL_PARALLEL_SIZE, 1) if saved.path == "zero" else 1
    if load_optimizer and experts > 1:   # its expert groups' optimizer files differ by expert-parallel rank
        raise ckpt.CheckpointError(f"{saved.directory} was saved at expert-model-parallel size {experts}: its optimizer "
                                   "state loads only at that size and the saving model-parallel size; pass "
                                   "--no-load-optim (or --finetune) to take the weights")
    if load_optimizer and not saved.has_optimizer_state():
        raise ckpt.CheckpointError(f"{saved.directory} has no optimizer state (saved with --no-save-optim?): pass "
                                   "--no-load-optim or --finetune to start it fresh")
    if is_zero_engine(model):
        if load_optimizer:
            name_of = {id(p): n for n, p in params.items()}
            model.optimizer.load_full_state(lambda param, kind: shard(name_of[id(param)], kind),
                                            [saved.optimizer_scalars(i) for i in range(len(saved.param_names))],
                                            saved.optimizer_hyperparameters(), saved.loss_scaler_state())
        else:
            model.optimizer.refresh_masters_from_parameters()
    elif load_optimizer:
        _load_megatron_optimizer(optimizer, module, saved, shard)
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if fresh:
        return TrainState()
    train_state = saved.train_state()
    if load_optimizer and saved.lr_scheduler_state() is not None:
        try:
            lr_scheduler.load_state_dict(saved.lr_scheduler_state())
        except ValueError as e:
            raise ckpt.CheckpointError(f"{saved.directory}: {e}") from None
    if is_zero_engine(model):
        model.set_step_counters(train_state.iteration, train_state.skipped_iterations)
    rng = saved.rng_state(rank) if saved.model_parallel_size == world else None
    if rng is not None and not options.no_load_rng:
        set_rng_state(rng)
    return train_state


def _load_megatron_optimizer(optimizer, module, saved, shard):
    """torch Adam/AdamW or Muon, or FP16_Optimizer around it: each parameter's fp32 master and moments (Muon's
    momentum for its matrices) copied into the optimizer's own tensors one parameter at a time (no second copy of
    the state is ever built)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    muon = {id(p) for group in inner.param_groups if group.get("use_muon") for p in group["params"]}
    params = dict(module.named_parameters())
    masters = dict(zip(map(id, optimizer.model_params), optimizer.master_params)) \
        if hasattr(optimizer, "master_params") else {}
    saved_groups = {n: i for i, group in enumerate(saved.param_names) for n in group}
    with torch.no_grad():
        for name in (n for group in optimizer_param_names(module, optimizer) for n in group):
            param = params[name]
            stepped = masters.get(id(param), param)          # what the inner optimizer updates
            if stepped is not param:
                stepped.copy_(shard(name, "master"))
                param.copy_(stepped)
            state = inner.state.setdefault(stepped, {})
            for kind in ckpt.MUON_KINDS if id(stepped) in muon else ckpt.ADAM_KINDS:
                value = shard(name, kind)
                if value is None:
                    check_other_optimizer(lambda _, other: shard(name, other), param, kind)
                    inner.state.pop(stepped, None)
                    break
                if kind in state:
                    state[kind].copy_(value)
                else:
                    state[kind] = value
            else:
                state.update({k: v.clone() if torch.is_tensor(v) else v
                              for k, v in saved.optimizer_scalars(saved_groups[name]).items()})
    for group, saved_group in zip(inner.param_groups, saved.optimizer_hyperparameters() or []):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and saved.loss_scaler_state() is not None:
        scaler.load_state_dict(saved.loss_scaler_state())
