"""Muon through DeepSpeed 0.19.8 and through our engine: the same model (our GPT2Model at mp 1), the same
{"optimizer": {"type": "Muon"}} JSON, data parallel 2 on gloo, ZeRO 1 and 2, fp32, 5 steps. DeepSpeed runs on its CPU
accelerator, its Gram Newton-Schulz held to fp32 (its own choice on a CPU without fp16 kernels; one with them would
iterate in fp16) and its AdamW half torch's AdamW ("torch_adam": DeepSpeed's FusedAdam would JIT-compile its C++ CPU
kernel first, ~80 s of CPU on a fresh machine): ns_method "gram" on both sides. Clipping is off: DeepSpeed
orthogonalizes before it clips (the clip then scales the update), we after (the momentum takes the clipped
gradient)."""
import importlib.util

import pytest

from megatron.spawn import run_distributed
from tests.helpers import max_relative_difference
from tests.zero.test_deepspeed_oracle import _deepspeed, _gathered_parameters, _gpt_batch, TinyGPT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is a test requirement: pip install -r requirements-test.txt")

STEPS, MICRO = 5, 2
OPTIMIZER = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.1,
                                        "betas": [0.9, 0.95], "eps": 1e-6, "ns_method": "gram"}}


def _train(library, stage):
    import torch.distributed as dist
    model = TinyGPT()
    optimizer = OPTIMIZER if library.__name__ == "megatron.zero" else {   # our engine has no torch_adam key
        **OPTIMIZER, "params": {**OPTIMIZER["params"], "torch_adam": True}}
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
              "optimizer": optimizer, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        x, y = _gpt_batch(step, MICRO * world)
        loss = engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, _gathered_parameters(library, engine)


def _both(stages):
    import torch
    torch._dynamo.config.disable = True   # DeepSpeed torch.compiles its Muon kernels: eager here (minutes less)
    deepspeed = _deepspeed()
    # DeepSpeed iterates Gram Newton-Schulz in fp16 where the accelerator has fp16 kernels (a CPU with AMX-FP16 /
    # AVX512-FP16 does: its update then differs from ours by ~1e-2) and in fp32 elsewhere: fp32 here on every CPU,
    # so the comparison is of the two engines' mechanics, as on a CPU without fp16 kernels
    from deepspeed.runtime.zero.muon import original_muon
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    from megatron import zero
    return {stage: (_train(deepspeed, stage), _train(zero, stage)) for stage in stages}


def test_muon_equals_deepspeeds():
    results = run_distributed(_both, 2, args=((1, 2),), model_parallel_size=1, timeout=600)[0]
    for stage, ((ds_losses, ds_params), (our_losses, our_params)) in results.items():
        assert ds_losses[-1] < ds_losses[0] - 0.1, ds_losses         # DeepSpeed trained (not vacuous)
        assert ds_params.keys() == our_params.keys()
        worst = {k: max_relative_difference([our_params[k]], [ds_params[k]]) for k in ds_params}
        print(stage, max(worst.values()), max(worst, key=worst.get))
        assert max(worst.values()) <= 1e-5, (stage, sorted(worst.items(), key=lambda kv: -kv[1])[:3])
        assert max_relative_difference(our_losses, ds_losses) <= 1e-5, (stage, our_losses, ds_losses)
