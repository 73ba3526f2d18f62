"""Megatron's mixed-precision optimizer: low-precision (fp16/bf16) model parameters, fp32 master copies that
the inner optimizer updates, and (fp16) a dynamic loss scale from megatron.fp16.loss_scaler.

Per iteration (Megatron's interface):
    optimizer.zero_grad()
    optimizer.backward(loss, update_master_grads=False)   # scaled backward into the model's grads
    model.allreduce_params(...)                           # data-parallel reduction of the model's grads
    optimizer.update_master_grads()                       # fp32 copy, overflow check, unscale
    optimizer.clip_master_grads(max_norm)                 # global norm over model-parallel ranks
    optimizer.step()                                      # skip on overflow; else inner step + copy back
"""
import math

import torch
import torch.distributed as dist

import mpu


def _master_copy(param):
    master = param.detach().clone().float().requires_grad_(True)
    for attr in ("model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(master, attr, getattr(param, attr))
    return master


class FP16_Optimizer:
    """Wraps a torch optimizer built over the low-precision params; `scaler` None = no loss scaling (bf16)."""

    def __init__(self, optimizer, scaler=None):
        self.optimizer = optimizer
        self.scaler = scaler
        self.model_params, self.master_params = [], []
        for group in optimizer.param_groups:
            masters = [_master_copy(p) for p in group["params"]]
            self.model_params.extend(group["params"])
            self.master_params.extend(masters)
            group["params"] = masters
        self.overflow = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self):
        return self.scaler.scale if self.scaler is not None else 1.0

    cur_scale = loss_scale

    def zero_grad(self):
        for param in self.model_params + self.master_params:
            param.grad = None

    def backward(self, loss, update_master_grads=False):
        (loss.float() * self.loss_scale).backward()
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Copy the model's grads into fp32 master grads, detect inf/nan on any rank, unscale."""
        for model_param, master in zip(self.model_params, self.master_params):
            master.grad = None if model_param.grad is None else model_param.grad.detach().float()
        self.overflow = self._found_inf()
        if not self.overflow and self.loss_scale != 1.0:
            for master in self.master_params:
                if master.grad is not None:
                    master.grad.mul_(1.0 / self.loss_scale)

    def _found_inf(self):
        """inf/nan in any master grad on any rank; one device-to-host sync per step, not one per parameter."""
        flag = torch.zeros(1, device=mpu.get_device())
        for master in self.master_params:
            if master.grad is not None:
                flag = torch.maximum(flag, (~torch.isfinite(master.grad)).any().float().reshape(1))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip by the global norm (max_norm 0 or None: measure only). Returns the norm; inf on overflow (as the
        ZeRO engine's), never a finite stand-in: the training loop's non-finite check reads this value (bf16)."""
        if self.overflow:
            return math.inf
        return mpu.clip_grad_norm(self.master_params, max_norm if max_norm else math.inf, norm_type)

    def step(self):
        """Returns True when the step was taken, False when an overflow (inf/nan in a gradient on any rank)
        skipped it: fp16 and bf16 alike (bf16 has no scaler to update; the training loop stops or skips first)."""
        if self.scaler is not None:
            self.scaler.update(self.overflow)
        if self.overflow:
            return False
        self.optimizer.step()
        with torch.no_grad():
            for model_param, master in zip(self.model_params, self.master_params):
                model_param.copy_(master)
        return True

    def reload_model_params(self):
        """Copy the model's (low-precision) params into the fp32 masters: after loading weights without this
        optimizer's state (--finetune, --no-load-optim), or the next step() would write the old masters back."""
        with torch.no_grad():
            for model_param, master in zip(self.model_params, self.master_params):
                master.copy_(model_param)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(),
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "fp32_master_params": [m.detach().to("cpu", copy=True) for m in self.master_params],  # host
                "overflow": self.overflow}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["loss_scaler"] is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        with torch.no_grad():
            for master, saved, model_param in zip(self.master_params, state["fp32_master_params"], self.model_params):
                master.copy_(saved)
                model_param.copy_(saved)
        self.overflow = bool(state["overflow"])
