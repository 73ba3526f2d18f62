"""The engine API DeepSpeed-Chat calls beyond training (issue 45 rows 7, 10, 11, 13): an engine built without an
optimizer (reference, EMA and reward models), attributes forwarded to the module, `engine.tput_timer`, and the
optimizer's check_overflow / skip_step / quantize_nontrainable_params. DeepSpeed 0.19.8 is the reference where
it runs cheaply on a CPU (stage 0 and 2, fp32, one process)."""
import contextlib
import importlib.util
import io

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import batch, TinyNet

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}


class ClientNet(TinyNet):
    """A client model with the methods DeepSpeed-Chat calls through its engines, and one name the engine has too."""

    zero_optimization_stage = "the module's"      # the engine's own method wins over it

    def forward_value(self, x):
        return self.head(torch.tanh(self.fc2(self.norm(torch.nn.functional.gelu(self.fc1(x))))))

    def gradient_checkpointing_enable(self):
        self.checkpointing = True


def _config(stage, **extra):
    """Stage 3 partitions every parameter (none kept whole: TinyNet's are all below DeepSpeed's default threshold)."""
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return {**CONFIG, "zero_optimization": zero, **extra}


def _inference_engine(library, stage):
    """An engine without an optimizer next to the same model left plain: what they return for one input."""
    reference = ClientNet()
    engine, optimizer, _, scheduler = library.initialize(model=ClientNet(), config=_config(stage))
    x, y = batch(0, 2)
    with torch.no_grad():
        record = {"returned": (optimizer, scheduler), "loss": (engine(x, y), reference(x, y)),
                  "forward_value": (engine.forward_value(x), reference.forward_value(x))}
    record["loss_with_grad"] = (engine(x, y).detach(), reference(x, y).detach())
    engine.gradient_checkpointing_enable()
    record["forwarded"] = (engine.module.checkpointing, engine.zero_optimization_stage(), engine.fc1 is
                           engine.module.fc1)
    with pytest.raises(AttributeError, match="object has no attribute 'no_such_name'"):
        engine.no_such_name
    for call in (lambda: engine.backward(engine(x, y)), engine.step):
        with pytest.raises((RuntimeError, AssertionError), match="must provide optimizer during init"):
            call()
    record["lr"], record["grad_norm"] = engine.get_lr(), engine.get_global_grad_norm()
    return engine, reference, record


def _ours_without_optimizer():
    """Stages 0 and 3 at data-parallel 2: the forward equals the plain module's (stage 3: partitioned, released
    after each forward); stages 1 and 2 are refused, as DeepSpeed refuses them."""
    from megatron import zero
    results = {}
    for stage in (0, 3):
        engine, reference, record = _inference_engine(zero, stage)
        if stage == 3:
            record["partitioned"] = all(p.numel() == 0 for p in engine.module.parameters())
            state = engine.module_state_dict()
            record["weights"] = all(torch.equal(state[n], p) for n, p in reference.state_dict().items())
        results[stage] = record
    for stage in (1, 2):
        with pytest.raises(zero.ConfigError, match=f"zero stage {stage} requires an optimizer"):
            zero.initialize(model=ClientNet(), config=_config(stage))
    return results


def test_an_engine_without_optimizer_forwards_as_the_plain_module():
    for record in run_distributed(_ours_without_optimizer, 2, model_parallel_size=1):
        for stage in (0, 3):
            got = record[stage]
            assert got["returned"] == (None, None)
            for key in ("loss", "forward_value", "loss_with_grad"):
                assert torch.equal(*got[key]), (stage, key)
            assert got["forwarded"] == (True, stage, True)
            assert got["lr"] == [] and got["grad_norm"] is None
        assert record[3]["partitioned"] and record[3]["weights"]


# ---- the optimizer's overflow check and skip_step; the throughput timer ---------------------------------------
def _overflow_and_skip(stage):
    """check_overflow before and after one rank's gradient turns inf; skip_step skips one step, then steps apply."""
    import torch.distributed as dist
    from megatron import zero
    model = ClientNet()
    engine, optimizer, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              config=_config(stage))
    x, y = batch(0, 4)
    x, y = x[2 * dist.get_rank():][:2], y[2 * dist.get_rank():][:2]
    engine.backward(engine(x, y))
    finite = optimizer.check_overflow()
    engine.step()
    bad = x.clone()
    if dist.get_rank() == 1:
        bad[0, 3] = float("inf")          # one element on one rank
    engine.backward(engine(bad, y))
    overflow = (optimizer.check_overflow(external=True), optimizer.overflow)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.skip_step = True
    engine.step()
    skipped = (engine.was_step_applied(), engine.skipped_steps, optimizer.skip_step,
               all(torch.equal(p, before[n]) for n, p in model.named_parameters()))
    engine.backward(engine(x, y))
    engine.step()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        quantized = optimizer.quantize_nontrainable_params()
    return finite, overflow, skipped, engine.was_step_applied(), quantized, printed.getvalue()


@pytest.mark.parametrize("stage", [0, 2])
def test_check_overflow_and_skip_step(stage):
    for rank, (finite, overflow, skipped, applied, quantized, printed) in enumerate(
            run_distributed(_overflow_and_skip, 2, args=(stage,), model_parallel_size=1)):
        assert finite is False and overflow == (True, True)      # every rank sees rank 1's inf
        assert skipped == (False, 1, False, True) and applied
        assert quantized is None
        assert printed == ("[zero] quantize_nontrainable_params(): no effect (weights are never quantized here)\n"
                           if rank == 0 else "")


def _timer_counts(library):
    """DeepSpeed-Chat's loop: 2 epochs of 3 micro-steps at accumulation 2, update_epoch_count() after each."""
    model = ClientNet()
    engine, _, _, _ = library.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                         config=_config(0, gradient_accumulation_steps=2))
    counts = []
    for epoch in range(2):
        for step in range(3):
            x, y = batch(epoch * 3 + step, 2)
            engine.backward(engine(x, y))
            engine.step()
        timer = engine.tput_timer
        counts.append((timer.epoch_count, timer.micro_step_count, timer.global_step_count))
        timer.update_epoch_count()
    timer = engine.tput_timer
    return counts + [(timer.epoch_count, timer.micro_step_count, timer.global_step_count)]


def test_throughput_timer_counts():
    from megatron import zero
    assert _timer_counts(zero) == [(0, 3, 1), (1, 3, 3), (2, 0, 3)]


# ---- DeepSpeed 0.19.8 as the reference --------------------------------------------------------------------------
def _on_both():
    from megatron import zero
    from tests.zero.test_deepspeed_oracle import _deepspeed
    deepspeed = _deepspeed()
    without = {name: _inference_engine(library, 0)[2] for name, library in (("ours", zero), ("deepspeed", deepspeed))}
    timers = {name: _timer_counts(library) for name, library in (("ours", zero), ("deepspeed", deepspeed))}
    model = ClientNet()          # DeepSpeed's check_overflow: returns None, sets .overflow, has no `external`
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                   config=_config(2))
    engine.backward(engine(*batch(0, 2)))
    check = (optimizer.check_overflow(), optimizer.overflow)
    with pytest.raises(TypeError, match="external"):
        optimizer.check_overflow(external=True)
    return without, timers, check


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is a test requirement")
def test_deepspeed_agrees():
    without, timers, check = run_distributed(_on_both, 1, model_parallel_size=1, timeout=600)[0]
    ours, theirs = without["ours"], without["deepspeed"]
    assert ours["returned"] == theirs["returned"] == (None, None)
    for key in ("loss", "forward_value", "loss_with_grad"):
        assert torch.equal(ours[key][0], theirs[key][0]) and torch.equal(*theirs[key]), key
    assert ours["forwarded"] == theirs["forwarded"] == (True, 0, True)
    assert ours["lr"] == theirs["lr"] == [] and ours["grad_norm"] is theirs["grad_norm"] is None
    assert timers["ours"] == timers["deepspeed"]
    assert check == (None, False)
