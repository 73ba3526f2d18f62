"""engine.get_global_grad_norm() equals the total norm torch.nn.utils.clip_grad_norm_ returns in a single-process
plain-torch run, at every step: stages 0/1/2 at data-parallel 2 (fp32, clipping active, gradient accumulation),
and data-parallel 2 x model-parallel 2 with mpu layers (split parameters summed over model-parallel ranks,
duplicated ones counted once).

A gradient averaged over the wrong number of data-parallel ranks, or a norm not summed over all partitions and
model-parallel ranks, moves the norm by a factor, far outside the tolerance."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpu
from megatron import zero
from megatron.spawn import run_distributed
from tests.helpers import (HIDDEN, IN, OUT, ParallelTinyNet, TinyNet, ds_config, engine_train_step,
                           param_groups, reference_run)

STEPS, GLOBAL_BATCH, LR, CLIP = 8, 8, 1e-2, 0.05
TOLERANCE = 1e-6     # relative, per step


def reference_norms(make_model, clip=CLIP, steps=STEPS, global_batch=GLOBAL_BATCH):
    """Single process, plain torch AdamW on the whole global batch: clip_grad_norm_'s return value per step."""
    norms = []
    reference_run(steps, global_batch, lr=LR, clip=clip, make_model=make_model, grad_norms=norms)
    return norms


def _engine_norms(make_model, config, use_mpu):
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config,
                                      mpu=mpu if use_mpu else None, dist_init_required=False)
    norms = []
    for step in range(STEPS):
        engine_train_step(engine, step, GLOBAL_BATCH)
        norms.append(engine.get_global_grad_norm())
    return norms


def _relative_errors(norms, reference):
    assert len(norms) == len(reference)
    return [abs(a - b) / b for a, b in zip(norms, reference)]


# ---------------------------------------------------------------------------------------------- data parallel 2
def _clip(config, clip=CLIP):
    return {**config, "gradient_clipping": clip}


DP2_CONFIGS = {
    "stage0": _clip(ds_config(0, micro=4)),
    "stage0_accum_noclip": _clip(ds_config(0, micro=2, accumulation=2, reduce_bucket_size=100), clip=0.0),
    "stage1_accum": _clip(ds_config(1, micro=2, accumulation=2, reduce_bucket_size=100)),
    "stage2": _clip(ds_config(2, micro=4)),
    "stage2_accum_overlap": _clip(ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100,
                                            overlap_comm=True, contiguous_gradients=True)),
    "stage3_accum": _clip(ds_config(3, micro=2, accumulation=2, reduce_bucket_size=100,
                                    stage3_param_persistence_threshold=40)),
    "stage3_offload": _clip(ds_config(3, micro=4, offload_optimizer={"device": "cpu"},
                                      offload_param={"device": "cpu"})),
    "stage2_offload": _clip(ds_config(2, micro=4, offload_optimizer={"device": "cpu"})),
}


def _dp2_run(configs):
    return {name: _engine_norms(TinyNet, config, use_mpu=False) for name, config in configs.items()}


@pytest.fixture(scope="module")
def dp2_norms():
    return run_distributed(_dp2_run, 2, args=(DP2_CONFIGS,), timeout=240)


@pytest.mark.parametrize("name", list(DP2_CONFIGS))
def test_dp2_norm_equals_clip_grad_norm_every_step(dp2_norms, name):
    clip = DP2_CONFIGS[name]["gradient_clipping"]
    reference = reference_norms(TinyNet, clip=clip)
    if clip > 0:
        assert sum(n > clip for n in reference) >= STEPS // 2, reference   # clipping really active
    for rank, rank_norms in enumerate(dp2_norms):
        errors = _relative_errors(rank_norms[name], reference)
        assert max(errors) <= TOLERANCE, (rank, rank_norms[name], reference)


# ---------------------------------------------------------------------------------------------- model parallel
class PlainTinyNet(nn.Module):
    """ParallelTinyNet in plain torch, no mpu: the same draws from the same seed in the same order (each
    mpu linear draws its full [out, in] master weight with xavier_normal_, biases start at zero)."""

    def __init__(self, seed=4321):
        super().__init__()
        torch.manual_seed(seed)
        w1 = nn.init.xavier_normal_(torch.empty(HIDDEN, IN))
        w2 = nn.init.xavier_normal_(torch.empty(HIDDEN, HIDDEN))
        self.fc1_weight, self.fc1_bias = nn.Parameter(w1), nn.Parameter(torch.zeros(HIDDEN))
        self.fc2_weight, self.fc2_bias = nn.Parameter(w2), nn.Parameter(torch.zeros(HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x, y):
        h = F.gelu(F.linear(x, self.fc1_weight, self.fc1_bias))
        h = self.norm(torch.tanh(F.linear(h, self.fc2_weight, self.fc2_bias)))
        return F.mse_loss(self.head(h), y)


MP_CONFIG = _clip(ds_config(2, micro=2, accumulation=2, reduce_bucket_size=150))   # dp 2: 8 = 2 x 2 x 2


def _mp_run():
    return mpu.get_model_parallel_rank(), mpu.get_data_parallel_rank(), \
        _engine_norms(ParallelTinyNet, MP_CONFIG, use_mpu=True)


def test_dp2_x_mp2_norm_equals_clip_grad_norm_every_step():
    reference = reference_norms(PlainTinyNet)
    assert sum(n > CLIP for n in reference) >= STEPS // 2, reference
    results = run_distributed(_mp_run, 4, model_parallel_size=2, timeout=240)
    assert sorted((mp, dp) for mp, dp, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for mp_rank, dp_rank, norms in results:
        errors = _relative_errors(norms, reference)
        assert max(errors) <= TOLERANCE, (mp_rank, dp_rank, norms, reference)


# ---------------------------------------------------------------------------------------------- bf16
def _bf16_norms_and_reference(stages):
    """{stage: [(engine norm, vector_norm over the fp32 copies of the step's bf16 gradients)]} at data-parallel 1;
    each gradient is caught by a hook as autograd produces it, so stage 2's buckets are checked as well."""
    out = {}
    for stage in stages:
        model = TinyNet()
        engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=LR),
                                          config={**ds_config(stage, micro=4), "bf16": {"enabled": True}},
                                          dist_init_required=False)
        caught = []
        for p in engine.module.parameters():
            p.register_hook(lambda g: caught.append(g.detach().clone()))
        out[stage] = []
        for step in range(3):
            caught.clear()
            engine_train_step(engine, step, 4)
            assert len(caught) == len(list(model.parameters())) and all(g.dtype == torch.bfloat16 for g in caught)
            reference = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in caught])).item()
            out[stage].append((engine.get_global_grad_norm(), reference))
    return out


def test_bf16_norm_equals_vector_norm_of_the_fp32_gradients():
    """The 16-bit pieces' sums of squares (vector_norm with fp32 accumulation, squared) against an independent
    norm of the bf16 gradients cast to fp32: a missing square moves it far outside the tolerance."""
    results = run_distributed(_bf16_norms_and_reference, 1, args=((0, 1, 2),), model_parallel_size=1)[0]
    for stage, pairs in results.items():
        for norm, reference in pairs:
            assert abs(norm - reference) / reference <= TOLERANCE, (stage, pairs)
