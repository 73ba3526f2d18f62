"""AnnealingLR: linear warmup, then constant, linear or cosine decay to min_lr; a pure schedule of the
step count with a state_dict, so resumed runs continue on the same curve.

    lr(n) = max_lr * n / warmup_iter                                   n <= warmup_iter
    lr(n) = min_lr + (max_lr - min_lr) * f((n - warmup) / (decay - warmup)),  f: 1 | 1 - x | (1 + cos(pi x)) / 2
    lr(n) = min_lr                                                      n > decay_iters (constant: max_lr)

Resuming with a larger (or smaller) --train-iters and no --lr-decay-iters (`follows_train_iters`): the schedule is
the command line's, laid over the new --train-iters; iteration n of the resumed run gets the lr a run started with
the new --train-iters would have at n (`resumed_from_decay_iters` holds the checkpoint's decay_iters for the start-up
line). Every other disagreement with the checkpoint is an error naming the field, as in Megatron-LM.
"""
import math


class AnnealingLR:
    DECAY_STYLES = ("constant", "linear", "cosine")

    def __init__(self, optimizer, max_lr, min_lr, warmup_iter, decay_iters, decay_style, num_iters=0,
                 override_lr_scheduler=False, use_checkpoint_lr_scheduler=False, follows_train_iters=False):
        if decay_style not in self.DECAY_STYLES:
            raise ValueError(f"unknown lr decay style {decay_style!r}: choose one of {self.DECAY_STYLES}")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_iter = int(warmup_iter)
        self.decay_iters = max(int(decay_iters), 1)
        self.decay_style = decay_style
        self.num_iters = int(num_iters)
        self.override_lr_scheduler = override_lr_scheduler
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.follows_train_iters = follows_train_iters
        self.resumed_from_decay_iters = None   # set by load_state_dict when --train-iters re-laid the schedule
        self._apply(self.get_lr())

    def get_lr(self):
        n = self.num_iters
        if self.warmup_iter > 0 and n <= self.warmup_iter:
            return self.max_lr * n / self.warmup_iter
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup_iter, 1)
        progress = (n - self.warmup_iter) / span
        factor = 1.0 - progress if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * factor

    def _apply(self, lr):
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)   # Megatron-LM's per-group multiplier (Muon's half)

    def step(self, step_num=None):
        self.num_iters = self.num_iters + 1 if step_num is None else int(step_num)
        self._apply(self.get_lr())

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_iter": self.warmup_iter,
                "decay_iters": self.decay_iters, "decay_style": self.decay_style, "num_iters": self.num_iters}

    def load_state_dict(self, state):
        """--override-lr-scheduler keeps the command line's shape; otherwise the checkpoint's wins (and with
        neither flag, a disagreement is an error naming the field). With `follows_train_iters`, a changed
        decay_iters (and the warmup derived from it) is the command line's: --train-iters re-lays the schedule."""
        if not self.override_lr_scheduler:
            relaid = (self.follows_train_iters and not self.use_checkpoint_lr_scheduler
                      and self.decay_iters != state["decay_iters"])
            derived = ("decay_iters", "warmup_iter") if relaid else ()
            for key in ("max_lr", "min_lr", "warmup_iter", "decay_iters", "decay_style"):
                ours, theirs = getattr(self, key), state[key]
                if key in derived:
                    continue
                if ours != theirs and not self.use_checkpoint_lr_scheduler:
                    raise ValueError(f"lr scheduler {key}: command line {ours!r} != checkpoint {theirs!r}; pass "
                                     f"--use-checkpoint-lr-scheduler or --override-lr-scheduler")
                setattr(self, key, theirs)
            if relaid:
                self.resumed_from_decay_iters = state["decay_iters"]
        self.step(state["num_iters"])
