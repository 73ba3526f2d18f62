"""`deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam` as torch's Adam/AdamW with DeepSpeed's arguments.

DeepSpeed builds both from C++/CUDA sources on first use (minutes); torch now has the same multi-tensor kernels
(`adam_kernel_options`: fused where torch runs it on the parameters' device, else foreach), so a DeepSpeed client's
`FusedAdam(params, lr=..., betas=(0.9, 0.95))` steps with torch's kernel and the engine wraps it like any client
Adam. The math is DeepSpeed's: `adam_w_mode` / `adamw_mode` True (the default) is AdamW (decoupled decay), False is
Adam with L2 decay added to the gradient; weight_decay defaults to 0 (torch's AdamW: 0.01). What torch has no
kernel for is refused by name rather than run differently: `bias_correction=False`, `amsgrad=True` (DeepSpeed
refuses it too), `fp32_optimizer_states=False`.
"""
import torch

from ..builder import adam_kernel_options


def _torch_adam_options(params, bias_correction, amsgrad, adam_w_mode, who):
    """The keyword arguments of torch.optim.Adam for DeepSpeed's switches (and `params` as a list)."""
    if not bias_correction:
        raise ValueError(f"{who}(bias_correction=False) is not supported: torch's Adam kernels always correct "
                         "the moments' bias")
    if amsgrad:
        raise ValueError(f"{who}(amsgrad=True) is not supported (DeepSpeed does not support it either)")
    params = list(params)
    first = next((t for item in params for t in (item["params"] if isinstance(item, dict) else [item])), None)
    kernel = adam_kernel_options(first.device) if first is not None else {}
    return params, {"decoupled_weight_decay": bool(adam_w_mode), **kernel}


class FusedAdam(torch.optim.Adam):
    """DeepSpeed 0.19.8's signature and defaults; `set_grad_none` is zero_grad's default (set_to_none)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        params, options = _torch_adam_options(params, bias_correction, amsgrad, adam_w_mode, "FusedAdam")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **options)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None):
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed 0.19.8's signature and defaults (note `adamw_mode`, not FusedAdam's `adam_w_mode`). The moments are
    fp32 always (the engine steps fp32 masters), hence `fp32_optimizer_states=False` is refused."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: the moments are fp32")
        params, options = _torch_adam_options(model_params, bias_correction, amsgrad, adamw_mode,
                                              "DeepSpeedCPUAdam")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **options)
        self.adam_w_mode = adamw_mode
