"""fp16 overflow handling and loss scale, bf16 master slices, per-rank memory against the ZeRO formula, and
communication overlap (all at data-parallel 2, one spawned run)."""
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron import zero
from megatron.zero.partition import ALIGNMENT
from megatron.spawn import run_distributed
from tests.helpers import batch, param_groups, TinyNet

OVERFLOWS = [False, True, True, False, False, True, True, True]
EXPECTED_SCALES = [256.0, 256.0, 128.0, 128.0, 256.0, 256.0, 128.0, 128.0]   # hysteresis 2, window 2, min 128
BUCKET = 200


def _engine(config):
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000}
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config={**base, **config},
                                      dist_init_required=False)
    return engine


def _step(engine, step, inject_inf=False):
    x, y = batch(step, 4)
    rank = engine.ctx.data_parallel_rank
    loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    handle = None
    if inject_inf:        # only data-parallel rank 1 sees an inf
        handle = engine.module.fc2.weight.register_hook(lambda g: g * math.inf)
    engine.backward(loss)
    if handle is not None:
        handle.remove()
    engine.step()
    return loss.item()


def _snapshot(engine):
    params = [p.detach().clone() for p in engine.module.parameters()]
    moments = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()]
    return params, moments, engine.get_lr()


def _same(a, b):
    (pa, ma, la), (pb, mb, lb) = a, b
    return (la == lb and len(ma) == len(mb) and all(torch.equal(x, y) for x, y in zip(pa, pb)) and
            all(torch.equal(x[k], y[k]) for x, y in zip(ma, mb) for k in x))


def _fp16_run():
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                               "hysteresis": 2, "min_loss_scale": 128},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                                "warmup_num_steps": 10}},
                      "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET, "overlap_comm": True}})
    rank, report = engine.ctx.data_parallel_rank, []
    for step, overflow in enumerate(OVERFLOWS):
        before = _snapshot(engine)
        _step(engine, step, inject_inf=overflow and rank == 1)
        unchanged = _same(before, _snapshot(engine))
        report.append((engine.optimizer.overflow, unchanged, engine.optimizer.cur_scale))
    dtypes = {p.dtype for p in engine.module.parameters()}
    return report, engine.skipped_steps, engine.global_steps, dtypes


def _bf16_run():
    engine = _engine({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET}})
    losses = [_step(engine, step) for step in range(12)]
    opt = engine.optimizer
    masters_fp32 = all(m.dtype == torch.float32 for m in opt.masters)
    params_follow = all(torch.equal(g.own_partition(), m.to(torch.bfloat16)) for g, m in zip(opt.groups, opt.masters))
    return losses, masters_fp32, params_follow, {p.dtype for p in engine.module.parameters()}


def _memory_run():
    """Bytes of the partitioned tensors for bf16 stage 1 and 2 (after one step, so moments exist)."""
    out = {}
    for stage in (1, 2):
        engine = _engine({"bf16": {"enabled": True},
                          "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                                "contiguous_gradients": True}})
        _step(engine, 0)
        _step(engine, 1)
        out[stage] = dict(engine.optimizer.partitioned_state_bytes())
        out[stage]["bucket_peak"] = getattr(engine.optimizer.reducer, "peak_bucket_bytes", 0)
        out[stage]["groups"] = len(engine.optimizer.groups)
    return out


def _overlap_run():
    """Record every dist.reduce: was it asynchronous, and was autograd still running when it was issued?"""
    calls, original = [], dist.reduce

    def recording_reduce(*args, **kwargs):
        calls.append((kwargs.get("async_op", False), torch._C._current_graph_task_id() != -1))
        return original(*args, **kwargs)

    dist.reduce = recording_reduce
    try:
        out = {}
        for overlap in (True, False):
            calls.clear()
            engine = _engine({"zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET,
                                                    "overlap_comm": overlap, "contiguous_gradients": True}})
            _step(engine, 0)
            out[overlap] = list(calls)
        return out
    finally:
        dist.reduce = original


def _all():
    return {"fp16": _fp16_run(), "bf16": _bf16_run(), "memory": _memory_run(), "overlap": _overlap_run()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2)


def test_fp16_overflow_on_one_rank_skips_everywhere(results):
    for rank_result in results:
        report, skipped, global_steps, dtypes = rank_result["fp16"]
        assert dtypes == {torch.float16}
        assert [overflow for overflow, _, _ in report] == OVERFLOWS
        assert [unchanged for _, unchanged, _ in report] == OVERFLOWS   # params, moments and lr untouched
        assert [scale for _, _, scale in report] == EXPECTED_SCALES
        assert skipped == sum(OVERFLOWS) and global_steps == len(OVERFLOWS)


def test_bf16_trains_with_fp32_master_slices(results):
    losses, masters_fp32, params_follow, dtypes = results[0]["bf16"]
    assert dtypes == {torch.bfloat16} and masters_fp32 and params_follow
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])


def test_memory_matches_zero_formula(results):
    """Per rank, bytes of fp32 master + Adam moments + held gradients = the ZeRO paper's figure for the stage
    (2-byte params and gradients, K = 12), up to the alignment padding; stage 2 adds one bucket per group."""
    dp, P = 2, sum(p.numel() for p in TinyNet().parameters())
    for rank_result in results:
        memory = rank_result["memory"]
        pad = memory[1]["groups"] * dp * ALIGNMENT                     # padding elements, at most
        s1, s2 = memory[1], memory[2]
        assert 2 * P <= s1["parameters"] <= 2 * (P + pad)
        assert 12 * P / dp <= s1["master"] + s1["moments"] <= 12 * (P + pad) / dp
        assert 2 * P <= s1["gradients"] <= 2 * (P + pad)                  # stage 1: full gradients
        assert 12 * P / dp <= s2["master"] + s2["moments"] <= 12 * (P + pad) / dp
        assert 2 * P / dp <= s2["gradients"] <= 2 * (P + pad) / dp       # stage 2: 1/dp of them
        # plus one bf16 bucket buffer per param group (each group's bucket fills independently)
        assert 0 < s2["bucket_peak"] <= 2 * BUCKET * memory[2]["groups"]


def test_overlap_issues_reductions_during_backward(results):
    for rank_result in results:
        overlapped, synchronous = rank_result["overlap"][True], rank_result["overlap"][False]
        assert len(overlapped) > 3 and len(overlapped) == len(synchronous)
        assert all(async_op and in_backward for async_op, in_backward in overlapped)
        assert all(not async_op and in_backward for async_op, in_backward in synchronous)


# ---- an inf that only the other rank's partition receives ----------------------------------------------------
COLLECTIVE_TIMEOUT = timedelta(seconds=20)     # a rank that steps while the other skips fails here, not hangs
FOREIGN_INF_STEPS = [False, True, False]        # the inf goes into step 1 only
FOREIGN_INF_SCALES = [256.0, 128.0, 128.0]      # 2**8; hysteresis 1: the overflow halves it; window 1000


class _DataParallelGroupWithTimeout:
    """The mpu protocol over both ranks (data parallel 2, model parallel 1), on a group with a short timeout."""

    def __init__(self):
        self.group = dist.new_group([0, 1], timeout=COLLECTIVE_TIMEOUT)

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.group)

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1


def _element_owned_by(engine, owner):
    """(parameter, index into its flattened gradient) of an element inside `owner`'s stage-2 partition, found
    from the flat layout: the middle of the first parameter that overlaps that partition."""
    for group in engine.optimizer.groups:
        start, end = group.partition_range(owner)
        for param, (s, e) in zip(group.params, group.offsets):
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                flat = (lo + hi) // 2
                own_start, own_end = group.own_range
                assert start <= flat < end and (own_start <= flat < own_end) == (group.rank == owner)
                return param, flat - s
    raise AssertionError(f"rank {owner} owns no parameter element")


def _foreign_inf_run():
    helper = _DataParallelGroupWithTimeout()
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1,
                       "min_loss_scale": 1},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, mpu=helper,
                                      dist_init_required=False)
    rank = engine.ctx.data_parallel_rank
    param, index = _element_owned_by(engine, owner=1)
    report = []
    for step, inject in enumerate(FOREIGN_INF_STEPS):
        x, y = batch(step, 4)
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        handle = None
        if inject and rank == 0:            # rank 0 computes the inf, but it lies in rank 1's slice
            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[index] = math.inf
                return grad
            handle = param.register_hook(poison)
        before = _snapshot(engine)
        engine.backward(loss)
        if handle is not None:
            handle.remove()
        # what each rank's own partition holds after the reduction (before the step zeroes it)
        local_finite = all(bool(torch.isfinite(engine.optimizer.reducer.partition_grad(i)).all())
                           for i in range(len(engine.optimizer.groups)))
        engine.step()
        dist.monitored_barrier(group=helper.group, timeout=COLLECTIVE_TIMEOUT)
        report.append((local_finite, engine.optimizer.overflow, _same(before, _snapshot(engine)),
                       engine.optimizer.cur_scale))
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    return report, engine.skipped_steps, params


def test_fp16_inf_in_the_other_ranks_partition_skips_everywhere():
    results = run_distributed(_foreign_inf_run, 2, timeout=120)
    for rank, (report, skipped, _) in enumerate(results):
        local_finite = [finite for finite, _, _, _ in report]
        # premise: only rank 1's partition ever held the inf that rank 0 computed
        assert local_finite == ([True, True, True] if rank == 0 else [True, False, True]), (rank, report)
        assert [overflow for _, overflow, _, _ in report] == FOREIGN_INF_STEPS, (rank, report)
        assert [unchanged for _, _, unchanged, _ in report] == FOREIGN_INF_STEPS, (rank, report)
        assert [scale for _, _, _, scale in report] == FOREIGN_INF_SCALES, (rank, report)
        assert skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))
