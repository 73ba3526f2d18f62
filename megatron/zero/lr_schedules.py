"""DeepSpeed's JSON learning-rate schedules: WarmupLR and WarmupDecayLR (same formulas as DeepSpeed).

Warmup over `warmup_num_steps` from warmup_min_lr to warmup_max_lr, with gamma(step) = log(step + 1) /
log(warmup_num_steps) ("log", the default) or step / warmup_num_steps ("linear"); then WarmupLR holds the maximum
and WarmupDecayLR decays linearly to 0 at `total_num_steps`. `step()` is called once per optimizer step that was
not skipped; the constructor sets the minimum lr. A group's `lr_mult` (Megatron-LM's name; Muon's half) multiplies
its lr: the schedule's lr is the AdamW half's, the Muon half's is muon_lr / adam_lr times it.
"""
import math


class WarmupLR:
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type {warmup_type!r} is not 'log' or 'linear'")
        self.optimizer = optimizer
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._set_lr(self.min_lr)

    def _gamma(self):
        step = self.last_batch_iteration
        if step < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(step + 1) / math.log(self.warmup_num_steps)
            return step / self.warmup_num_steps
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [self.min_lr for _ in self.optimizer.param_groups]
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma()
        return [lr for _ in self.optimizer.param_groups]

    def get_last_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def _set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self.step(self.last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < warmup_num_steps:
            raise ValueError(f"total_num_steps ({total_num_steps}) < warmup_num_steps ({warmup_num_steps})")

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}
