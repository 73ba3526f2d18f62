"""Muon in the ZeRO engine (DeepSpeed's {"type": "Muon"} config) against a single-process reference written from the
published algorithm (Keller Jordan's muon.py: Nesterov momentum, quintic Newton-Schulz, sqrt(max(1, rows/cols))
scaling, decoupled weight decay; torch's AdamW for embeddings, norms and biases), on a tiny GPT-2 (fp32, dropout off),
5 steps: ZeRO 0-3 at data parallel 2, tensor parallel 1 and 2."""
import math

import pytest
import torch
import torch.distributed as dist

from megatron.spawn import run_distributed
from tests.helpers import gathered_model_parallel, max_relative_difference

MODEL = dict(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4, max_sequence_length=16)
STEPS, GLOBAL_BATCH, SEQ = 5, 4, 16
MUON_LR, ADAM_LR, MOMENTUM, WEIGHT_DECAY, BETAS, EPS = 0.02, 3e-3, 0.95, 0.1, (0.9, 0.95), 1e-6
OPTIMIZER = {"type": "Muon", "params": {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM,
                                        "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS}}


def _model(seed=1234, dtype=torch.float32, **overrides):
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(seed)
    return GPT2Model(GPT2ModelConfig(**dict(MODEL, **overrides)), parallel_output=True).to(dtype)


def _tokens(step):
    """Rows counting up from a random start by 1, 2 or 3 (mod the vocabulary): learnable in a few steps."""
    generator = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, 1), generator=generator)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ + 1)) % MODEL["vocab_size"]
    return tokens[:, :-1], tokens[:, 1:]


# ---- the reference: the published algorithm, written here -------------------------------------------------------
def reference_newton_schulz(G, steps=5):
    """Keller Jordan's zeropower_via_newtonschulz5 (in fp32 rather than bf16)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(torch.promote_types(G.dtype, torch.float32))
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def is_hidden_matrix(name, param):
    return param.ndim >= 2 and "embed" not in name and "output_layer" not in name


def reference_run(dtype=torch.float32, steps=STEPS, overrides=None):
    """One process, the whole batch; Muon as published for the hidden matrices, torch AdamW for the rest."""
    model = _model(dtype=dtype, **(overrides or {}))
    muon = [(n, p) for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    adam = torch.optim.AdamW([p for n, p in model.named_parameters() if not is_hidden_matrix(n, p)], lr=ADAM_LR,
                             betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    buffers = {n: torch.zeros_like(p) for n, p in muon}
    losses = []
    for step in range(steps):
        tokens, labels = _tokens(step)
        model.zero_grad()
        adam.zero_grad()
        gradients = []
        halves = [model(t, labels=l).mean() for t, l in zip(tokens.chunk(2), labels.chunk(2))]
        for loss in halves:
            loss.backward()
            gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        for n, p in model.named_parameters():
            p.grad = (gradients[0][n] + gradients[1][n]) / 2
        losses.append((halves[0].item() + halves[1].item()) / 2)
        with torch.no_grad():
            for name, p in muon:
                g, buf = p.grad, buffers[name]
                buf.lerp_(g, 1 - MOMENTUM)
                update = g.lerp(buf, MOMENTUM)
                update = reference_newton_schulz(update) * max(1, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - MUON_LR * WEIGHT_DECAY)
                p.add_(update, alpha=-MUON_LR)
        adam.step()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# ---- the engine --------------------------------------------------------------------------------------------------
def engine_run(stage, dtype=torch.float32, steps=STEPS, overrides=None, extra_config=None, zero_init=False):
    """(losses, full state, names of the Muon half) of a ZeRO run; `zero_init`: the model built under zero.Init
    (at stage 3 each parameter is a 1-D piece before the optimizer is built)."""
    import mpu
    from megatron import zero
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(), enabled=zero_init):
        model = _model(dtype=dtype, **(overrides or {}))
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    micro = GLOBAL_BATCH // dp
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0,
              "steps_per_print": 10 ** 6, "optimizer": OPTIMIZER, "zero_optimization": {"stage": stage},
              **(extra_config or {})}
    engine, optimizer, _, _ = zero.initialize(model=model, config=config, mpu=mpu, dist_init_required=False)
    losses = []
    for step in range(steps):
        tokens, labels = _tokens(step)
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        loss = engine(tokens[rows], labels=labels[rows]).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).double()
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
    return losses, _full_state(engine.module, stage), _muon_half(engine)


def _muon_half(engine):
    """The names of the parameters the engine steps with Muon (its flat groups tagged as the Muon half)."""
    names = {id(p): name for name, p in engine.module.named_parameters()}
    wrapped = engine.optimizer
    return sorted(names[id(p)] for group, muon in zip(wrapped.groups, wrapped.muon_groups) if muon
                  for p in group.params)


def _full_state(module, stage):
    from megatron import zero
    if stage == 3:
        with zero.GatheredParameters(list(module.parameters())):
            return {k: v.cpu() for k, v in gathered_model_parallel(module).items()}
    return {k: v.cpu() for k, v in gathered_model_parallel(module).items()}


def _all_stages(dtype):
    return {stage: engine_run(stage, dtype) for stage in (0, 1, 2, 3)}


def _references():
    return {dtype: reference_run(dtype) for dtype in (torch.float32, torch.float64)}


@pytest.fixture(scope="module")
def references():
    return run_distributed(_references, 1, model_parallel_size=1)[0]


# Newton-Schulz's polynomial has slope a^5 ~ 480 at zero: the rounding by which a tensor-parallel forward differs
# from one process (~1e-7 in fp32 gradients) comes out ~50x larger in the parameters after 5 steps (measured
# 4.8e-6). In fp64 the same run equals the reference within 1e-6; at tensor parallel 1 fp32 does too.
TOLERANCE = {(1, torch.float32): 1e-6, (2, torch.float64): 1e-6, (2, torch.float32): 2e-5}


@pytest.mark.parametrize("model_parallel,dtype", list(TOLERANCE))
def test_muon_at_every_zero_stage_equals_the_published_algorithm(references, model_parallel, dtype):
    ref_losses, ref_state = references[dtype]
    results = run_distributed(_all_stages, 2 * model_parallel, args=(dtype,), model_parallel_size=model_parallel)
    tolerance = TOLERANCE[model_parallel, dtype]
    for by_stage in results:
        for stage, (losses, state, muon_half) in by_stage.items():
            assert max_relative_difference(losses, ref_losses) <= tolerance, (stage, losses, ref_losses)
            assert set(state) == set(ref_state)
            assert max_relative_difference(state, ref_state) <= tolerance, stage
            assert muon_half == _hidden_matrices(ref_state), stage
    assert ref_losses[-1] < ref_losses[0] - 0.1          # it trains


def _hidden_matrices(state):
    return sorted(name for name, value in state.items() if is_hidden_matrix(name, value))


def _zero2_and_zero3_under_zero_init():
    return engine_run(2), engine_run(3, zero_init=True)


def test_zero3_under_zero_init_splits_and_trains_as_zero2(references):
    """Built under zero.Init, every parameter is a 1-D piece when ZeRO-3's optimizer splits them: the Muon half is
    still the hidden matrices (by their whole shape), the 8 of ZeRO-2's, and the losses and weights equal ZeRO-2's
    and the reference's."""
    ref_losses, ref_state = references[torch.float32]
    for zero2, zero3 in run_distributed(_zero2_and_zero3_under_zero_init, 2, model_parallel_size=1):
        assert len(zero2[2]) == 8 and zero3[2] == zero2[2] == _hidden_matrices(ref_state)
        assert max_relative_difference(zero3[0], zero2[0]) <= 1e-6, (zero3[0], zero2[0])
        assert max_relative_difference(zero3[1], ref_state) <= 1e-6


def test_newton_schulz_matches_the_reference_and_gram_equals_standard():
    from megatron.zero.muon import newton_schulz
    generator = torch.Generator().manual_seed(3)
    for shape in [(8, 24), (24, 8), (16, 16), (1, 5)]:
        G = torch.randn(shape, generator=generator)
        expected = reference_newton_schulz(G)
        assert torch.allclose(newton_schulz(G), expected, atol=1e-6, rtol=0)
        assert torch.allclose(newton_schulz(G, method="gram"), expected, atol=2e-5, rtol=0)
        singular = torch.linalg.svdvals(expected)
        assert singular.max() < 1.3 and singular.min() > 0.5 or min(shape) == 1


def test_scheduled_lr_keeps_the_muon_to_adam_ratio():
    """The schedulers set lr x lr_mult: the AdamW half follows the schedule, the Muon half muon_lr / adam_lr x it."""
    from megatron.learning_rates import AnnealingLR
    from megatron.zero import Muon, muon_settings, split_param_groups
    from megatron.zero.lr_schedules import WarmupLR
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    muon, adam = muon_settings({"muon_lr": 0.05, "adam_lr": 0.002})
    optimizer = Muon(split_param_groups(model, model.parameters(), muon, adam))
    assert [(g["use_muon"], len(g["params"])) for g in optimizer.param_groups] == [(True, 1), (False, 3)]
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.002]
    WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.002, warmup_num_steps=4, warmup_type="linear").step(2)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.001], rel=1e-12)
    AnnealingLR(optimizer, max_lr=0.002, min_lr=0.0, warmup_iter=0, decay_iters=10, decay_style="linear",
                num_iters=5)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.001], rel=1e-12)


@pytest.mark.parametrize("params,muon_lr,adam_lr", [({"lr": 0.01}, 0.01, 0.01),
                                                     ({"lr": 0.01, "muon_lr": 0.05}, 0.05, 0.01),
                                                     ({"lr": 0.01, "adam_lr": 0.002}, 0.01, 0.002)])
def test_the_json_lr_is_both_halves_unless_muon_lr_or_adam_lr_overrides_it(params, muon_lr, adam_lr):
    """DeepSpeed's optimizer.params: `lr` is shared, `muon_lr` / `adam_lr` override it for their half (0.01 is
    neither half's default, 0.02 and 3e-4)."""
    from megatron.zero import build_optimizer, load_config
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    config = load_config({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}})
    optimizer = build_optimizer(config.optimizer, model.parameters(), model)
    assert [(g["use_muon"], g["lr"]) for g in optimizer.param_groups] == [(True, muon_lr), (False, adam_lr)]
    assert optimizer.param_groups[0]["lr_mult"] == pytest.approx(muon_lr / adam_lr, rel=1e-12)


def _halves_of_an_untied_model():
    from megatron.zero import build_optimizer, load_config
    model = _model(untie_embeddings_and_output_weights=True)
    config = load_config({"train_batch_size": 1, "optimizer": OPTIMIZER})
    optimizer = build_optimizer(config.optimizer, model.parameters(), model)
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: g["use_muon"] for g in optimizer.param_groups for p in g["params"]}


def test_an_untied_output_layer_steps_with_adamw_as_the_embedding():
    """--untie-embeddings-and-output-weights: output_layer.weight [V, h] is the head, not a hidden matrix."""
    halves = run_distributed(_halves_of_an_untied_model, 1, model_parallel_size=1)[0]
    assert halves["output_layer.weight"] is False and halves["word_embeddings.weight"] is False
    assert sorted(name for name, muon in halves.items() if muon) == \
        sorted(name for name in halves if ".layers." in name and name.endswith("weight") and "norm" not in name)


# ---- checkpoints: bitwise resume, and a data-parallel-2 checkpoint loaded at data parallel 1 ---------------------
def _train(engine, first, last):
    import mpu
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(first, last):
        tokens, labels = _tokens(step)
        for k in range(engine.gradient_accumulation_steps()):
            rows = slice((dp_rank * engine.gradient_accumulation_steps() + k) * micro, None)
            loss = engine(tokens[rows][:micro], labels=labels[rows][:micro]).mean()
            engine.backward(loss)
            engine.step()


def _engine(stage, accumulation=1):
    import mpu
    from megatron import zero
    dp = mpu.get_data_parallel_world_size()
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": accumulation,
              "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // accumulation, "gradient_clipping": 1.0,
              "steps_per_print": 10 ** 6, "optimizer": OPTIMIZER, "zero_optimization": {"stage": stage}}
    return zero.initialize(model=_model(), config=config, mpu=mpu, dist_init_required=False)[0]


def _save_and_resume(stage, directory):
    engine = _engine(stage)
    _train(engine, 0, 3)
    engine.save_checkpoint(directory, tag="step3")
    _train(engine, 3, STEPS)
    uninterrupted = _full_state(engine.module, stage)
    resumed = _engine(stage)
    resumed.load_checkpoint(directory, tag="step3")
    _train(resumed, 3, STEPS)
    return uninterrupted, _full_state(resumed.module, stage)


def _load_at_dp1(stage, directory):
    engine = _engine(stage, accumulation=2)       # the same two half-batch gradients as data parallel 2
    engine.load_checkpoint(directory, tag="step3")
    _train(engine, 3, STEPS)
    return _full_state(engine.module, stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_resumes_bitwise_and_loads_at_another_data_parallel_size(tmp_path, stage):
    results = run_distributed(_save_and_resume, 2, args=(stage, str(tmp_path)), model_parallel_size=1)
    uninterrupted, resumed = results[0]
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), name
    at_dp1 = run_distributed(_load_at_dp1, 1, args=(stage, str(tmp_path)), model_parallel_size=1)[0]
    assert max_relative_difference(at_dp1, uninterrupted) <= 1e-6
