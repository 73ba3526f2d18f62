"""ZeRO stages 0-3 (and offload) at data-parallel 2 against a single-process torch AdamW run (fp32, same global batch).

One spawned run trains every configuration in turn; the parent compares each with the reference.
"""
import pytest
import torch
import torch.distributed as dist

import mpu

from megatron import zero
from megatron.spawn import run_distributed
from tests.helpers import ds_config, engine_train_step, max_relative_difference, param_groups, reference_run, TinyNet

STEPS, GLOBAL_BATCH, LR, CLIP = 20, 8, 1e-2, 0.05
TOLERANCE = 1e-6


def train(config, steps=STEPS, lr=LR, engine_hook=None):
    """Train TinyNet through the engine on this rank's share of each global batch.

    Returns (global losses per step, final state_dict, engine). Rank r, micro-step k takes samples
    [(r * accumulation + k) * micro, ... + micro) of the global batch.
    """
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=lr)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    if engine_hook is not None:
        engine_hook(engine)
    losses = [engine_train_step(engine, step, engine.train_batch_size()) for step in range(steps)]
    state = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
    return losses, state, engine


def _train_all(configs):
    return [train(config)[:2] for config in configs]


STAGE_CONFIGS = {
    "stage0": ds_config(0, micro=4),
    "stage1": ds_config(1, micro=4),
    "stage2": ds_config(2, micro=4),
    "stage0_accum": ds_config(0, micro=2, accumulation=2),
    "stage1_accum": ds_config(1, micro=2, accumulation=2),
    "stage2_accum": ds_config(2, micro=2, accumulation=2),
    "stage1_small_buckets": ds_config(1, micro=4, reduce_bucket_size=100, allgather_bucket_size=37),
    "stage2_overlap_contiguous": ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100,
                                           allgather_bucket_size=37, overlap_comm=True, contiguous_gradients=True),
    "stage2_overlap": ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100, allgather_bucket_size=37,
                                overlap_comm=True, contiguous_gradients=False),
    "stage2_contiguous": ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100, allgather_bucket_size=37,
                                   overlap_comm=False, contiguous_gradients=True),
    "stage2_plain": ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100, allgather_bucket_size=37,
                              overlap_comm=False, contiguous_gradients=False),
    "stage2_allreduce": ds_config(2, micro=4, reduce_bucket_size=100, reduce_scatter=False),
    "stage3": ds_config(3, micro=4),
    # small buckets, prefetch of about one unit, biases and the LayerNorm kept whole (persistent)
    "stage3_accum_small": ds_config(3, micro=2, accumulation=2, reduce_bucket_size=100, overlap_comm=True,
                                    contiguous_gradients=True, stage3_prefetch_bucket_size=600,
                                    stage3_param_persistence_threshold=40),
    "stage3_offload": ds_config(3, micro=2, accumulation=2, reduce_bucket_size=100, stage3_prefetch_bucket_size=0,
                                offload_optimizer={"device": "cpu", "pin_memory": True},
                                offload_param={"device": "cpu", "pin_memory": True}),
    "stage3_tiles": ds_config(3, micro=4, sub_group_size=100),    # the optimizer steps 100-element tiles
    "stage2_offload": ds_config(2, micro=2, accumulation=2, reduce_bucket_size=100,
                                offload_optimizer={"device": "cpu"}),
    "stage1_offload": ds_config(1, micro=4, cpu_offload=True),
}
CLIP_CONFIGS = {f"{name}_clip": {**ds_config(stage, micro=2, accumulation=2, reduce_bucket_size=100),
                                 "gradient_clipping": CLIP} for name, stage in
                (("stage0", 0), ("stage1", 1), ("stage2", 2), ("stage3", 3))}
CLIP_CONFIGS["stage3_offload_clip"] = {**STAGE_CONFIGS["stage3_offload"], "gradient_clipping": CLIP}
CLIP_CONFIGS["stage2_offload_clip"] = {**STAGE_CONFIGS["stage2_offload"], "gradient_clipping": CLIP}


@pytest.fixture(scope="module")
def dp2_results():
    names = list(STAGE_CONFIGS) + list(CLIP_CONFIGS)
    configs = [{**STAGE_CONFIGS, **CLIP_CONFIGS}[n] for n in names]
    results = run_distributed(_train_all, 2, args=(configs,))
    for rank_results in results[1:]:          # every rank ends with the same parameters
        for (_, s0), (_, s1) in zip(results[0], rank_results):
            assert max_relative_difference(s1, s0) == 0.0
    return dict(zip(names, results[0]))


@pytest.mark.parametrize("name", list(STAGE_CONFIGS))
def test_matches_single_process_adamw(dp2_results, name):
    ref_losses, ref_state = reference_run(STEPS, GLOBAL_BATCH, lr=LR)
    losses, state = dp2_results[name]
    assert max_relative_difference(losses, ref_losses) <= TOLERANCE
    assert max_relative_difference(state, ref_state) <= TOLERANCE
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", list(CLIP_CONFIGS))
def test_clipping_matches_torch_clip_grad_norm(dp2_results, name):
    ref_losses, ref_state = reference_run(STEPS, GLOBAL_BATCH, lr=LR, clip=CLIP)
    unclipped_losses, _ = reference_run(STEPS, GLOBAL_BATCH, lr=LR)
    assert max_relative_difference(ref_losses, unclipped_losses) > 1e-3     # clipping is really active
    losses, state = dp2_results[name]
    assert max_relative_difference(losses, ref_losses) <= TOLERANCE
    assert max_relative_difference(state, ref_state) <= TOLERANCE


def test_overlap_and_contiguous_gradients_do_not_change_results(dp2_results):
    base_losses, base_state = dp2_results["stage2_plain"]
    for name in ("stage2_overlap_contiguous", "stage2_overlap", "stage2_contiguous"):
        losses, state = dp2_results[name]
        assert losses == base_losses
        assert max_relative_difference(state, base_state) == 0.0


def test_single_process_engine_without_torch_distributed():
    """dp = 1 and no process group: the engine still trains (every collective is skipped)."""
    assert not dist.is_initialized()
    ref_losses, ref_state = reference_run(5, 4, lr=LR)
    losses, state, engine = train(ds_config(2, micro=4), steps=5)
    assert max_relative_difference(losses, ref_losses) <= TOLERANCE
    assert max_relative_difference(state, ref_state) <= TOLERANCE
    assert engine.global_steps == 5 and engine.get_global_grad_norm() > 0


def test_square_sums_live_on_the_collective_device():
    """The sums that go into the norm's all-reduce are on the collective device even when the gradients are in
    host memory (offload) or a param group is empty: "meta" stands in for the accelerator."""
    from megatron.zero.grad_norm import local_square_sums
    grads = [torch.zeros(0), torch.full((3,), 2.0)]
    sums = local_square_sums(grads, [([], []), ([(0, 3)], [])], torch.device("meta"))
    assert sums.device.type == "meta"
    assert local_square_sums(grads, [([], []), ([(0, 2)], [(2, 3)])], torch.device("cpu")).tolist() == [8.0, 4.0]


def test_stage3_offloaded_parameters_norm_on_the_compute_device():
    """ZeRO-3 with offload_param and no offload_optimizer: partitions and gradients are host memory, the grad
    norm's collective device is still the parameters' (compute) device."""
    from megatron.zero import offload
    config = ds_config(3, micro=4)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    _, _, engine = train(config, steps=1)
    assert engine.optimizer.collective_device == mpu.get_device()
    assert all(offload.is_host_offload(g.partition) for g in engine.optimizer.groups)
    assert all(offload.is_host_offload(engine.optimizer.reducer.partition_grad(i))
               for i in range(len(engine.optimizer.groups)))
