"""overlap_param_gather (stages 1-2): step() returns with the parameter all-gathers in flight, each module's
forward waits for its own buckets only, and everything is bitwise what it is without overlap (losses, every
parameter, a checkpoint and a run resumed from it), with gradient accumulation 2 and clipping active.

The gather buckets of TinyNet at dp 2 with allgather_bucket_size 128, counted by hand: the weights group
(fc1 512 + fc2 1024 + head 256 = 1792 elements, partition 896) has 7 chunks of <= 128; the bias/norm group (136,
padded to 192, partition 96) one. fc1.weight fills [0, 512) of partition 0: chunks 0-3; fc1.bias sits in the
second group's only chunk: fc1 needs 5 of the 8 buckets, and they are launched first.
With an unused Linear(32, 64) added (weights group 3840, partition 1920, 15 chunks), chunk 14 holds only it:
that bucket is still in flight when the next step rewrites the partitions, which must wait for it first.
"""
import os

import pytest
import torch

import mpu
from megatron import zero
from megatron.checkpoint import layout
from megatron.spawn import run_distributed
from tests.helpers import (HIDDEN, ParallelTinyNet, TinyNet, batch, device, ds_config, engine_train_step,
                           max_relative_difference, param_groups, reference_run)

STEPS, LR, CLIP, MICRO, ACCUMULATION, BUCKET = 3, 1e-2, 0.05, 2, 2, 128
BUCKETS, FC1_BUCKETS = 8, 5       # hand-counted in the docstring


def _config(stage, overlap, **extra):
    config = ds_config(stage, micro=MICRO, accumulation=ACCUMULATION, reduce_bucket_size=100,
                       allgather_bucket_size=BUCKET, overlap_param_gather=overlap)
    return {**config, "gradient_clipping": CLIP, **extra}


class _TinyNetWithUnused(TinyNet):
    """TinyNet plus a layer its forward never calls."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(HIDDEN, 2 * HIDDEN).to(device())


def _engine(config, make_model=TinyNet, use_mpu=False):
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False,
                                      mpu=mpu if use_mpu else None)
    return engine


def _train(config, steps=STEPS, make_model=TinyNet, use_mpu=False):
    """(losses, every parameter after the last step, gathers in flight when each step() returned, skipped steps,
    gathers in flight when each inner AdamW step began and before the forward of each step)."""
    engine = _engine(config, make_model, use_mpu)
    gather, inner = engine.optimizer.param_gather, engine.optimizer.optimizer
    at_update = []
    inner.register_step_pre_hook(lambda *_: at_update.append(len(gather.pending)))
    losses, in_flight = [], []
    for step in range(steps):
        losses.append(engine_train_step(engine, step, engine.train_batch_size()))
        in_flight.append(len(gather.pending))
    engine.wait_for_parameters()
    return (losses, [p.detach().clone() for p in engine.module.parameters()], in_flight, engine.skipped_steps,
            at_update, len(gather.buckets))


def _holds(bucket, params):
    """Whether any piece of `bucket` shares memory with any of `params` (by addresses: independent of the
    index arithmetic that built the buckets)."""
    def span(t):
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(a < d and c < b for a, b in map(span, bucket.pieces()) for c, d in map(span, params))


def _hook_probe():
    """After one step: which buckets each module's forward (an eval forward, under no_grad) found waited."""
    engine = _engine(_config(2, True))
    gather = engine.optimizer.param_gather
    engine_train_step(engine, 0, engine.train_batch_size())
    index = {bucket: i for i, bucket in enumerate(gather.buckets)}
    launched = [index[b] for b in gather.pending]
    seen = []

    def probe(name):        # registered after the engine's hooks, so it runs after them
        def hook(_module, _inputs):
            seen.append((name, sorted(index[b] for b in gather.waited), sorted(index[b] for b in gather.pending)))
        return hook
    holds = {}
    for name, module in engine.module.named_modules():
        module.register_forward_pre_hook(probe(name))
        holds[name] = [i for i, b in enumerate(gather.buckets) if _holds(b, list(module.parameters(recurse=False)))]
    x, y = batch(1, MICRO)
    with torch.no_grad():
        engine(x, y)
    return launched, seen, holds


def _save_load(overlap, directory):
    """Train, read state_dict() and save right after a step (gathers in flight), resume in a fresh engine."""
    engine = _engine(_config(2, overlap))
    gather = engine.optimizer.param_gather
    pending_at_read = []
    for step in range(STEPS):
        engine_train_step(engine, step, engine.train_batch_size())
    engine.module.register_state_dict_pre_hook(lambda *_: pending_at_read.append(len(gather.pending)))
    in_flight = [len(gather.pending)]
    direct = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine_train_step(engine, STEPS, engine.train_batch_size())
    in_flight.append(len(gather.pending))
    engine.save_checkpoint(directory, tag="t")
    saved = layout.safe_torch_load(os.path.join(directory, "t", layout.model_states_name(0)))[layout.MODULE]
    fresh = _engine(_config(2, overlap))
    fresh.load_checkpoint(directory, tag="t")
    loss = engine_train_step(fresh, STEPS + 1, fresh.train_batch_size())
    fresh.wait_for_parameters()
    return (direct, saved, loss, [p.detach().clone() for p in fresh.module.parameters()], in_flight,
            pending_at_read)


def _dp2_cases(directory):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1, "hysteresis": 1}}
    runs = {f"stage{stage}_{'on' if overlap else 'off'}": _train(_config(stage, overlap))
            for stage in (1, 2) for overlap in (True, False)}
    runs.update({f"fp16_{'on' if overlap else 'off'}": _train(_config(2, overlap, **fp16), steps=6)
                 for overlap in (True, False)})
    runs.update({f"unused_{'on' if overlap else 'off'}": _train(_config(1, overlap), make_model=_TinyNetWithUnused)
                 for overlap in (True, False)})
    checkpoints = {overlap: _save_load(overlap, f"{directory}/{'on' if overlap else 'off'}")
                   for overlap in (True, False)}
    return runs, _hook_probe(), checkpoints


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_distributed(_dp2_cases, 2, args=(str(tmp_path_factory.mktemp("overlap")),))


def _assert_bitwise_equal(a, b):
    assert a[0] == b[0]                                              # the losses
    assert len(a[1]) == len(b[1]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_is_bitwise_equal_and_matches_single_process(dp2, stage):
    ref_losses, ref_state = reference_run(STEPS, MICRO * ACCUMULATION * 2, lr=LR, clip=CLIP)
    for rank_runs, _, _ in dp2:
        on, off = rank_runs[f"stage{stage}_on"], rank_runs[f"stage{stage}_off"]
        _assert_bitwise_equal(on, off)
        assert max_relative_difference(on[0], ref_losses) <= 1e-6
        assert max_relative_difference(on[1], list(ref_state.values())) <= 1e-6
        assert on[2] == [BUCKETS] * STEPS and off[2] == [0] * STEPS    # in flight when step() returned
    assert all(torch.equal(p, q) for p, q in zip(dp2[0][0]["stage2_on"][1], dp2[1][0]["stage2_on"][1]))


def test_overflow_skip_with_gathers_in_flight(dp2):
    """fp16, dynamic scale doubling every clean step: an overflow follows a clean step, so the skipped step
    starts with gathers in flight and must leave the parameters whole."""
    for rank_runs, _, _ in dp2:
        on, off = rank_runs["fp16_on"], rank_runs["fp16_off"]
        assert on[3] == off[3] >= 1 and on[2][0] == BUCKETS                 # skipped steps; a clean first step
        assert 0 in on[2]                                                   # an overflow launched nothing
        _assert_bitwise_equal(on, off)


def test_the_step_waits_for_a_gather_no_forward_waited_for(dp2):
    """The unused layer's bucket is still in flight after the forward; the next update must start after it."""
    for rank_runs, _, _ in dp2:
        on, off = rank_runs["unused_on"], rank_runs["unused_off"]
        assert on[5] == 15 + 1 and on[2] == [on[5]] * STEPS
        assert on[4] == [0] * STEPS
        _assert_bitwise_equal(on, off)


def test_each_forward_waits_for_its_own_buckets_only(dp2):
    for _, (launched, seen, holds), _ in dp2:
        assert len(launched) == BUCKETS and len(holds["fc1"]) == FC1_BUCKETS
        assert sorted(launched[:FC1_BUCKETS]) == holds["fc1"]              # fc1's buckets go first
        assert [name for name, _, _ in seen] == ["", "fc1", "norm", "fc2", "head"]   # the forward's order
        needed = set()
        for name, waited, pending in seen:
            needed |= set(holds[name])
            assert waited == sorted(needed) and pending == sorted(set(range(BUCKETS)) - needed), name
        assert seen[0][1] == [] and len(seen[1][2]) == BUCKETS - FC1_BUCKETS   # the rest still in flight at fc1


def test_state_dict_and_checkpoint_after_an_overlapped_step(dp2):
    for _, _, checkpoints in dp2:
        on, off = checkpoints[True], checkpoints[False]
        assert on[4] == [BUCKETS, BUCKETS] and off[4] == [0, 0]            # in flight before the read, the save
        assert on[5] == [0, 0]                                             # ... and waited for before reading
        for mine, theirs in ((on[0], off[0]), (on[1], off[1])):
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert on[2] == off[2] and all(torch.equal(p, q) for p, q in zip(on[3], off[3]))


def _mp_cases():
    return {overlap: _train(_config(2, overlap), make_model=ParallelTinyNet, use_mpu=True)
            for overlap in (True, False)}


def test_overlap_at_data_parallel_2_x_model_parallel_2():
    results = run_distributed(_mp_cases, 4, model_parallel_size=2)
    for runs in results:
        _assert_bitwise_equal(runs[True], runs[False])
        assert min(runs[True][2]) > 0 and runs[False][2] == [0] * STEPS
