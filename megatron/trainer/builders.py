"""What setup_model_and_optimizer (megatron/training.py) builds besides the model and the optimizer: Megatron-LM's
weight-decay groups of a model's parameters, and the learning-rate schedule of --lr."""
import torch

import mpu
from megatron.global_vars import get_args
from megatron.learning_rates import AnnealingLR


NORMALIZATIONS = (torch.nn.LayerNorm, torch.nn.RMSNorm)   # mpu's LayerNorm and RMSNorm subclass these


def param_groups_for_weight_decay(module):
    """Biases and the parameters of every normalization (LayerNorm, RMSNorm) get no weight decay (Megatron-LM's
    grouping); MoE expert parameters are grouped alike in groups of their own. Frozen parameters (LoRA's base weights) are in no group: no optimizer state; an empty group is left
    out."""
    decay, no_decay, expert_decay, expert_no_decay = [], [], [], []
    for submodule in module.modules():
        for name, param in submodule.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            expert = mpu.is_expert_parameter(param)
            if isinstance(submodule, NORMALIZATIONS) or name == "bias":
                (expert_no_decay if expert else no_decay).append(param)
            else:
                (expert_decay if expert else decay).append(param)
    # MoE experts in groups of their own (after the others): expert parallelism reduces them over another group
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0},
              {"params": expert_decay}, {"params": expert_no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def get_learning_rate_scheduler(optimizer, lr=None):
    """--lr's schedule; with `lr`, the same schedule scaled to peak at it (min_lr scaled alike)."""
    args = get_args()
    scale = 1.0 if lr is None else lr / args.lr
    return AnnealingLR(optimizer, max_lr=args.lr * scale, min_lr=args.min_lr * scale,
                       warmup_iter=int(args.warmup * args.lr_decay_iters), decay_iters=args.lr_decay_iters,
                       decay_style=args.lr_decay_style, override_lr_scheduler=args.override_lr_scheduler,
                       use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
                       follows_train_iters=not args.lr_decay_iters_given)


def resumed_lr_line(lr_scheduler, iteration):
    """The start-up line of a resumed run: the lr its next iteration gets and the schedule it follows (re-laid when
    --train-iters changed since the checkpoint, AnnealingLR.load_state_dict). None for another scheduler."""
    if not isinstance(lr_scheduler, AnnealingLR):
        return None
    shape = (f"{lr_scheduler.decay_style} over {lr_scheduler.decay_iters} iterations, warmup "
             f"{lr_scheduler.warmup_iter}")
    if lr_scheduler.resumed_from_decay_iters is None:
        source = "the checkpoint's schedule"
    else:
        source = (f"re-laid by --train-iters {lr_scheduler.decay_iters} (the checkpoint's ran over "
                  f"{lr_scheduler.resumed_from_decay_iters}): each iteration gets the lr a run started with "
                  f"--train-iters {lr_scheduler.decay_iters} has there")
    return f" > resuming at iteration {iteration}: lr {lr_scheduler.get_lr():.6E} ({shape}; {source})"
