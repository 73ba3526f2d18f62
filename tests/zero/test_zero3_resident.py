"""ZeRO-3 keeps a group resident where its partition is the whole group (stage3.py, "Resident"): at data-parallel
size 1 no gather, release or per-unit hook runs, the parameters are whole between steps as views of their partition,
and training equals ZeRO-2 and torch AdamW; offload_param is gathered as before; LoRA's frozen base weights,
GatheredParameters (with and without a modifier rank), swapped_partitions, the memory books and checkpoints keep
their meaning; an MoE expert group at
expert-data-parallel size 1 is resident beside dense groups gathered at dp 2. The gather path at dp > 1 is
test_zero3.py's, its books at dp 1 (stage3_resident_at_dp1 off) test_stage3_lifecycle.py's."""
import pytest
import torch
import torch.distributed as dist

from megatron import zero
from megatron.guards import memory
from megatron.spawn import run_distributed
from megatron.zero import stage3
from tests.helpers import (TinyNet, batch, engine_train_step, gathered_model_parallel, max_relative_difference,
                           param_groups, reference_run)
from tests.zero.test_zero3 import MORE, SAVE_AT, _ckpt_engine, _continue, _engine, _stage3, _steps

STEPS, CLIP = 3, 1.0       # clipping on (the engine's default): it binds in these steps


@pytest.fixture
def counted(monkeypatch):
    """Calls of _Buffer.start_gather and of stage 3's forward pre-hook, counted by name."""
    counts = {"gathers": 0, "pre_hooks": 0}

    def count(name, method):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(stage3._Buffer, "start_gather", count("gathers", stage3._Buffer.start_gather))
    monkeypatch.setattr(stage3.Stage3Parameters, "_pre_forward",
                        count("pre_hooks", stage3.Stage3Parameters._pre_forward))
    return counts


def _views_of_partitions(engine, partitions=None):
    """Every parameter whole, AVAILABLE and its data inside one of `partitions` (default: the groups' own)."""
    partitions = partitions if partitions is not None else [g.partition for g in engine.stage3.groups]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in partitions]
    return all(tuple(p.shape) == tuple(p.ds_shape) and p.ds_status == zero.ZeroParamStatus.AVAILABLE
               and any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in engine.module.parameters())


def _train(config):
    engine = _engine({"gradient_clipping": CLIP, **config})
    losses, resident = [], []
    for step in range(STEPS):
        losses.append(engine_train_step(engine, step, 2))
        resident.append(engine.stage3 is None or _views_of_partitions(engine))
    return engine, losses, resident


def test_dp1_is_resident_and_trains_as_stage2_and_adamw(counted):
    engine, losses, resident = _train(_stage3())
    assert counted == {"gathers": 0, "pre_hooks": 0} and engine.stage3.handles == []
    assert all(resident) and all(b.resident for b in engine.stage3.buffers) and engine.stage3.persistent is None
    weights = engine.module_state_dict()
    stage2, stage2_losses, _ = _train({"zero_optimization": {"stage": 2, "reduce_bucket_size": 100}})
    assert max_relative_difference(losses, stage2_losses) <= 1e-6
    assert max_relative_difference(weights, stage2.module_state_dict()) <= 1e-6
    ref_losses, ref_weights = reference_run(STEPS, 2, clip=CLIP)
    assert max_relative_difference(losses, ref_losses) <= 1e-6
    assert max_relative_difference(weights, ref_weights) <= 1e-6


def test_offload_param_and_the_opt_out_gather_at_dp1_and_train_the_same(counted):
    ref_losses, ref_weights = reference_run(STEPS, 2, clip=CLIP)
    for extra in ({"offload_param": {"device": "cpu"}}, {"stage3_resident_at_dp1": False}):
        counted["gathers"] = 0
        engine, losses, resident = _train(_stage3(**extra))
        assert counted["gathers"] > 0 and not any(resident) and not any(b.resident for b in engine.stage3.buffers)
        assert max_relative_difference(losses, ref_losses) <= 1e-6, extra
        assert max_relative_difference(engine.module_state_dict(), ref_weights) <= 1e-6, extra


def test_frozen_lora_base_weights_at_dp1_are_resident_and_train_as_gathered():
    """LoRA's frozen base weight (in the stateless group, no optimizer state) is resident too and stays put; the
    adapters train as on the gather path (stage3_resident_at_dp1 off)."""
    from tests.zero.test_stage3_lifecycle import _LoRANet, _engine as lora_engine
    runs = {}
    for resident in (True, False):
        engine = lora_engine(_LoRANet(), stage3_resident_at_dp1=resident)
        base = engine.module_state_dict()["adapted.weight"]
        losses = [engine_train_step(engine, step, 2) for step in range(STEPS)]
        runs[resident] = losses, engine.module_state_dict(), base
        assert engine.stage3.buffer_of[id(engine.module.adapted.weight)].resident == resident
        assert _views_of_partitions(engine) == resident
    (losses, weights, base), (gathered_losses, gathered_weights, _) = runs[True], runs[False]
    assert torch.equal(weights["adapted.weight"], base)
    assert max_relative_difference(losses, gathered_losses) <= 1e-6
    assert max_relative_difference(weights, gathered_weights) <= 1e-6


def test_gathered_parameters_at_dp1_keep_edits_with_a_modifier_rank_only():
    """test_zero3.py's discarded-edits case in one process, on a resident weight and a small (at dp 2 persistent)
    bias: AVAILABLE throughout; edits inside GatheredParameters without a modifier rank are lost (they went to a
    copy: read again, and in a forward), with modifier_rank=0 they are written into the partition; after each
    context the parameters view their partition again. A client that fetches only NOT_AVAILABLE parameters
    (DeepSpeed-Chat's moving_average) fetches none at dp 1 and edits the weights themselves, as at stages 0-2."""
    engine = _engine(_stage3())
    engine_train_step(engine, 0, 2)
    bias, weight = engine.module.fc1.bias, engine.module.fc1.weight
    before = (bias.detach().clone(), weight.detach().clone())
    x, y = batch(1, 2)
    with torch.no_grad():
        loss = engine(x, y).item()
    statuses = [[p.ds_status.name for p in (bias, weight)]]
    with zero.GatheredParameters([bias, weight]):
        statuses.append([p.ds_status.name for p in (bias, weight)])
        bias.data.fill_(0.5)
        weight.data.fill_(0.25)
    statuses.append([p.ds_status.name for p in (bias, weight)])
    assert statuses == [["AVAILABLE", "AVAILABLE"]] * 3
    assert torch.equal(bias, before[0]) and torch.equal(weight, before[1]) and _views_of_partitions(engine)
    with torch.no_grad():
        assert engine(x, y).item() == loss
    with zero.GatheredParameters([bias, weight], modifier_rank=0):
        weight.data.fill_(0.25)
    group = next(g for g in engine.stage3.groups if any(p is weight for p in g.params))
    start, end = group.offsets[next(i for i, p in enumerate(group.params) if p is weight)]
    assert _views_of_partitions(engine) and bool((weight == 0.25).all()) and torch.equal(bias, before[0])
    assert bool((group.partition[start:end] == 0.25).all())         # written into the partition (own range 0..)
    with zero.GatheredParameters([p for p in (bias,) if p.ds_status == zero.ZeroParamStatus.NOT_AVAILABLE]):
        bias.data.fill_(0.5)
    assert bool((bias == 0.5).all())


def test_swapped_partitions_at_dp1_repoint_the_views_and_back():
    """DPO's reference policy: a forward inside sees the swapped partitions (equal to a TinyNet holding those
    weights), after it the engine's own; the engine trains on as before."""
    engine = _engine(_stage3())
    engine_train_step(engine, 0, 2)
    x, y = batch(5, 2)
    with torch.no_grad():
        own = engine(x, y).item()
    halves = [g.partition * 0.5 for g in engine.stage3.groups]
    state = engine.module_state_dict()
    plain = TinyNet()
    plain.load_state_dict({k: v * 0.5 for k, v in state.items()})
    with engine.stage3.swapped_partitions(halves), torch.no_grad():
        inside = engine(x, y).item()
        swapped = _views_of_partitions(engine, halves)
    with torch.no_grad():
        after = engine(x, y).item()
        expected = plain(x, y).item()
    assert abs(inside - expected) <= 1e-6 * max(1.0, abs(expected)) and inside != own and swapped
    assert after == own and _views_of_partitions(engine)


def test_memory_books_at_dp1_count_the_whole_model_once():
    """Resident: the parameters' bytes are the partitions' (the whole model, padding included), nothing held a
    second time (no persistent copies), and the estimate says so."""
    engine = _engine(_stage3())
    engine_train_step(engine, 0, 2)
    measured = memory.measured_model_state_bytes(engine.optimizer)
    counts = [g.numel for g in engine.stage3.groups]
    estimate = memory.model_state_bytes(counts, "float32", engine.config, 1,
                                        parameter_sizes=[p.numel() for p in engine.module.parameters()])
    assert engine.optimizer.resident_parameter_bytes == 0
    assert measured["parameters"] == estimate["parameters"] == sum(g.parameter_bytes() for g in engine.stage3.groups)
    assert estimate == {**measured, "buckets": estimate["buckets"]}
    assert engine.stage3.live_parameter_elements() == sum(p.numel() for p in engine.module.parameters())


# ---- checkpoints: saved resident at dp 1, resumed at dp 1 and 2, and at stage 2 ------------------------------------
def _straight_dp1(save_dir):
    engine = _ckpt_engine(3)
    assert all(b.resident for b in engine.stage3.buffers)
    losses = _steps(engine, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="a")
    losses += _steps(engine, SAVE_AT, MORE)
    return losses, engine.module_state_dict()


def test_a_resident_checkpoint_resumes_at_dp1_and_dp2_and_at_stage2(tmp_path):
    save = str(tmp_path / "stage3_dp1")
    straight = run_distributed(_straight_dp1, 1, args=(save,))[0]
    same = run_distributed(_continue, 1, args=(save, 3, SAVE_AT, MORE))[0]
    assert same[0] == straight[0][SAVE_AT:]                        # bitwise at the same topology
    assert all(torch.equal(same[1][k], straight[1][k]) for k in straight[1])
    for dp, stage in ((2, 3), (1, 2)):
        moved = run_distributed(_continue, dp, args=(save, stage, SAVE_AT, MORE))[0]
        assert max_relative_difference(moved[0], straight[0][SAVE_AT:]) <= 1e-6, (dp, stage)
        assert max_relative_difference(moved[1], straight[1]) <= 1e-6, (dp, stage)


# ---- MoE: experts at expert-data-parallel size 1 resident, dense weights gathered at dp 2 -------------------------
def _moe_runs():
    """Per stage3_resident_at_dp1: (losses, whole weights, gathers, expert buffers resident, experts whole views and
    dense parameters empty between steps, dense buffers resident)."""
    import mpu
    from tests.zero.test_moe_engine import _micro_batch, _model, _optimizer
    mpu.initialize_expert_parallel(2)           # dp 2 = EP 2: expert-data-parallel size 1
    out = {}
    for resident in (True, False):
        model = _model(None)
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
                  "zero_optimization": {"stage": 3, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0,
                                        "stage3_resident_at_dp1": resident}}
        engine, _, _, _ = zero.initialize(model=model, optimizer=_optimizer(model), config=config, mpu=mpu)
        gathers = [0]
        for buffer in engine.stage3.buffers:
            def counted(start=buffer.start_gather):
                gathers[0] += 1
                start()
            buffer.start_gather = counted
        losses, between = [], []
        for step in range(STEPS):
            tokens, labels = _micro_batch(step, dist.get_rank())
            loss = engine(tokens, labels=labels).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            experts = [p for p in engine.module.parameters() if getattr(p, "expert_parallel", False)]
            dense = [p for p in engine.module.parameters() if not getattr(p, "expert_parallel", False)]
            between.append((all(p.numel() == p.ds_numel for p in experts), all(p.numel() == 0 for p in dense)))
        buffer_of = engine.stage3.buffer_of
        with zero.GatheredParameters(list(engine.module.parameters())):
            weights = gathered_model_parallel(engine.module)
        out[resident] = (losses, weights, gathers[0],
                         all(buffer_of[id(p)].resident for p in experts) and bool(experts),
                         between, any(buffer_of[id(p)].resident for p in dense))
    return out


def test_moe_experts_at_expert_dp1_are_resident_beside_gathered_dense_weights():
    for rank in run_distributed(_moe_runs, 2, model_parallel_size=1, timeout=240):
        losses, weights, gathers, experts_resident, between, dense_resident = rank[True]
        assert experts_resident and not dense_resident and gathers > 0
        assert between == [(True, True)] * STEPS
        off = rank[False]
        assert not off[3] and off[4] == [(False, True)] * STEPS
        assert max_relative_difference(losses, off[0]) <= 1e-6
        assert max_relative_difference(weights, off[1]) <= 1e-6
