"""Data-parallel 2 x model-parallel 2 (4 processes, mpu layers) equals model-parallel 2 alone and the single
process, with clipping active, so duplicated (not model-parallel) parameters must be counted once in the norm."""
import pytest
import torch
import torch.distributed as dist

import mpu
from megatron import zero
from megatron.spawn import run_distributed
from tests.helpers import (ParallelTinyNet, engine_train_step, max_relative_difference, param_groups,
                           reference_run)

STEPS, GLOBAL_BATCH, LR, CLIP = 8, 8, 1e-2, 0.05


def _full_state(model):
    """Parameters gathered over model-parallel ranks into their full-size shapes."""
    state = {}
    mp = mpu.get_model_parallel_world_size()
    for name, p in model.named_parameters():
        tensor = p.detach().float()
        if getattr(p, "model_parallel", False) and mp > 1:
            parts = [torch.empty_like(tensor) for _ in range(mp)]
            dist.all_gather(parts, tensor.contiguous(), group=mpu.get_model_parallel_group())
            tensor = torch.cat(parts, dim=p.partition_dim)
        state[name] = tensor
    return state


def _reference():
    """Single process, plain torch AdamW + clip_grad_norm_ (mpu layers at model-parallel size 1)."""
    return reference_run(STEPS, GLOBAL_BATCH, lr=LR, clip=CLIP, make_model=ParallelTinyNet)


def _engine_run(stage):
    model = ParallelTinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
              "steps_per_print": 1000, "zero_optimization": {"stage": stage, "reduce_bucket_size": 150}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                      dist_init_required=False)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(engine_train_step(engine, step, GLOBAL_BATCH))
        norms.append(engine.get_global_grad_norm())
    return losses, _full_state(engine.module), norms


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1, model_parallel_size=1)[0]


@pytest.mark.parametrize("world_size,stage", [(2, 1), (4, 2)])
def test_model_parallel_engine_matches_single_process(reference, world_size, stage):
    ref_losses, ref_state = reference
    results = run_distributed(_engine_run, world_size, args=(stage,), model_parallel_size=2)
    for losses, state, norms in results:
        assert max_relative_difference(losses, ref_losses) <= 1e-6
        assert max_relative_difference(state, ref_state) <= 1e-6
        assert norms == results[0][2]                       # every rank sees the same global norm
        assert max(norms) > CLIP                             # clipping was active
