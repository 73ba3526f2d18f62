"""fp32/bf16 non-finite values: a NaN gradient in one parameter stops the run with a one-line message naming the
parameter and iteration, without saving (the tracker keeps the last good checkpoint); --skip-nonfinite-steps
skips that step instead (parameters and Adam state equal those before it)."""
import os
import sys

import pytest
import torch

from megatron.spawn import free_port, run_distributed
from tests.helpers import NO_DROPOUT, REPO, TINY
from tests import warm_python

POISONED = "transformer.layers.1.mlp.dense_4h_to_h.weight"
CONSTANT_LR = ["--lr-decay-style", "constant", "--warmup", "0", "--log-interval", "1"]

_CLI = f"""
import runpy, sys, torch
import megatron.model as model_module
Base = model_module.GPT2Model
class Poisoned(Base):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        calls = [0]
        def hook(grad):
            calls[0] += 1
            return grad * float("nan") if calls[0] == 3 else grad
        dict(self.named_parameters())["{POISONED}"].register_hook(hook)
model_module.GPT2Model = Poisoned
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_nan_gradient_stops_without_saving(tmp_path):
    save = tmp_path / "checkpoints"
    flags = TINY + NO_DROPOUT + CONSTANT_LR + ["--train-iters", "6", "--save", str(save), "--save-interval", "2"]
    result = warm_python.run([sys.executable, "-c", _CLI] + flags, cwd=REPO, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, MASTER_PORT=str(free_port())))
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("error: non-finite values at iteration 3:")
    assert f"first non-finite gradient: {POISONED} (rank 0)" in errors[0]
    assert "stopping without saving (the latest checkpoint stays iteration 2" in errors[0]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000002"]


_STASH = []


def _train_poisoned(args_list, poison_iteration, poison_rank):
    """pretrain with a NaN in one parameter's gradient at one iteration on one rank; returns (history, parameters,
    optimizer state tensors) at the end."""
    import pretrain_gpt
    from megatron import training
    original = training.setup_model_and_optimizer

    def stash(model_provider):
        result = original(model_provider)
        _STASH[:] = result[:2]
        return result
    training.setup_model_and_optimizer = stash
    try:
        if poison_iteration:
            base = pretrain_gpt.model_provider

            def provider():
                model = base()
                calls = [0]

                def hook(grad):
                    calls[0] += 1
                    bad = calls[0] == poison_iteration and torch.distributed.get_rank() == poison_rank
                    return grad * float("nan") if bad else grad
                dict(model.named_parameters())[POISONED].register_hook(hook)
                return model
        else:
            provider = pretrain_gpt.model_provider
        history = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, provider,
                                    pretrain_gpt.forward_step, args_list=args_list)
    finally:
        training.setup_model_and_optimizer = original
    model, optimizer = _STASH
    module = training.unwrap_model(model)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in inner.state.values()]
    return history, params, state


@pytest.mark.parametrize("path", ["megatron", "deepspeed"])
def test_skip_nonfinite_steps_leaves_parameters_and_adam_state(tmp_path, path):
    flags = TINY + NO_DROPOUT + CONSTANT_LR + ["--batch-size", "2"]
    if path == "deepspeed":
        from tests.helpers import write_config
        flags += ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path))]
    skipped = run_distributed(_train_poisoned, 2, args=(flags + ["--train-iters", "3", "--skip-nonfinite-steps"],
                                                        3, 1))[0]
    reference = run_distributed(_train_poisoned, 2, args=(flags + ["--train-iters", "2"], 0, 0))[0]
    history, params, state = skipped
    assert history["skipped"] == [0, 0, 1]
    assert history["lm loss"][:2] == reference[0]["lm loss"]
    assert params.keys() == reference[1].keys()
    for name, value in params.items():
        assert torch.equal(value, reference[1][name]), name
    assert len(state) == len(reference[2]) > 0
    for mine, theirs in zip(state, reference[2]):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])), key


def _train_until_stopped(args_list):
    from megatron.guards.operations import NonFiniteError
    try:
        _train_poisoned(args_list, 2, 1)
    except NonFiniteError as error:
        return str(error)
    return None


def _stopped_then_one_nan_element(args_list):
    """The DeepSpeed-path run stopped by a NaN gradient, then the engine-level one-element checks in the same
    workers (they share the start-up)."""
    return _train_until_stopped(args_list), _zero_one_nan_element(1)


@pytest.fixture(scope="module")
def deepspeed_stopped(tmp_path_factory):
    from tests.helpers import write_config
    flags = TINY + NO_DROPOUT + CONSTANT_LR + ["--deepspeed", "--deepspeed_config",
                                               write_config(str(tmp_path_factory.mktemp("ds"))), "--train-iters", "4"]
    return run_distributed(_stopped_then_one_nan_element, 2, args=(flags,))


def test_deepspeed_path_names_the_parameter_and_stops(deepspeed_stopped):
    messages = [message for message, _ in deepspeed_stopped]
    assert messages[0] == messages[1] and messages[0].startswith("non-finite values at iteration 2:"), messages
    assert f"first non-finite gradient: {POISONED} (rank " in messages[0]


class _ThreeParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)          # first.weight [3, 4], first.bias [3]
        self.second = torch.nn.Linear(3, 5)


def test_megatron_path_names_the_parameter_with_one_bad_element():
    """operations.first_nonfinite_gradient: one NaN (or inf) element of a non-first parameter's gradient is enough;
    all finite (or no gradients) is None."""
    from megatron.guards.operations import first_nonfinite_gradient
    module = _ThreeParameters()
    assert first_nonfinite_gradient(module) is None                 # no gradients yet
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    module.second.weight.grad = None                                # a parameter without a gradient is skipped
    assert first_nonfinite_gradient(module) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        module.first.bias.grad = torch.ones(3)
        module.first.bias.grad[1] = bad
        assert first_nonfinite_gradient(module) == "first.bias", bad
    module.first.bias.grad = torch.ones(3)
    module.second.bias.grad[4] = float("nan")                       # the last element of the last parameter
    assert first_nonfinite_gradient(module) == "second.bias"


# TinyNet's decayed group [fc1.weight 512 | fc2.weight 1024 | head.weight 256], 1792 elements, dp 2: rank 0 owns
# [0, 896), rank 1 [896, 1792). Element 300 of fc2.weight sits at 812 (rank 0), element 600 at 1112 (rank 1).
ZERO_POISON = {300: 0, 600: 1}


def _zero_one_nan_element(poison_rank):
    """For each stage and poisoned element of fc2.weight (one NaN on one rank's local gradient, before the
    reduction): (stage, element, this rank's last_nonfinite_param name, the name every rank reports, steps skipped)."""
    from megatron import zero
    from megatron.guards.operations import gather_first_name
    from tests.helpers import TinyNet, batch, ds_config, param_groups
    rank, out = torch.distributed.get_rank(), []
    for stage in (1, 2, 3):
        for element in ZERO_POISON:
            model = TinyNet()
            engine, optimizer, _, _ = zero.initialize(
                model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2), dist_init_required=False,
                config=ds_config(stage, 2, reduce_bucket_size=300, stage3_param_persistence_threshold=40))
            optimizer.skip_nonfinite = True                 # as training.py sets it (fp32/bf16)

            def poison(grad, element=element):
                if rank != poison_rank:
                    return grad
                grad = grad.clone()
                grad.view(-1)[element] = float("nan")
                return grad
            handle = engine.module.fc2.weight.register_hook(poison)
            x, y = batch(0, 4)
            engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
            engine.step()
            handle.remove()
            param = optimizer.last_nonfinite_param
            name = next((n for n, p in engine.module.named_parameters() if p is param), None)
            out.append((stage, element, name, gather_first_name(name), engine.skipped_steps))
    return out


def test_zero_engine_names_the_parameter_with_one_bad_element(deepspeed_stopped):
    """ZeroOptimizer.last_nonfinite_param after one NaN element (not a whole NaN tensor) in fc2.weight's gradient
    on rank 1, stages 1-3: the rank owning that element after the reduction names fc2.weight, the other None;
    the step is skipped; the name every rank reports (operations.gather_first_name) is the owner's."""
    for rank, (_, rank_results) in enumerate(deepspeed_stopped):
        assert len(rank_results) == 6
        for stage, element, name, reported, skipped in rank_results:
            owner = ZERO_POISON[element]
            assert name == ("fc2.weight" if rank == owner else None), (rank, stage, element, name)
            assert reported == f"fc2.weight (rank {owner})", reported
            assert skipped == 1, (stage, element, skipped)


def test_min_loss_scale_watch_counts_only_skips_at_the_minimum():
    from megatron.guards.operations import LossScaleStuckError, MinLossScaleWatch
    watch = MinLossScaleWatch(min_scale=1.0, limit=3, initial_scale=4.0)
    # (skipped, scale after the step): two ordinary skips down to the minimum, two at it, a clean step resets
    for iteration, (skipped, scale) in enumerate([(1, 2.0), (1, 1.0), (1, 1.0), (1, 1.0), (0, 1.0), (1, 1.0),
                                                  (1, 1.0)], 1):
        watch.check(iteration, skipped, scale, {"lm loss": 1.0}, None)
    assert watch.streak == 2
    with pytest.raises(LossScaleStuckError, match=r"iterations 6-8 all overflowed at that scale"):
        watch.check(8, 1, 1.0, {"lm loss": 1.0}, None)
    never = MinLossScaleWatch(min_scale=1.0, limit=0, initial_scale=1.0)
    for iteration in range(1, 20):
        never.check(iteration, 1, 1.0, {"lm loss": 1.0}, None)


def _train_overflowing_fp16(args_list):
    """pretrain with every training loss made inf (every fp16 gradient overflows); the error's text, or None."""
    import pretrain_gpt
    from megatron import training
    from megatron.guards.operations import LossScaleStuckError

    def forward_step(data_iterator, model):
        loss, reduced = pretrain_gpt.forward_step(data_iterator, model)
        return (loss * float("inf") if model.training else loss), reduced
    try:
        training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, forward_step,
                          args_list=args_list)
    except LossScaleStuckError as error:
        return str(error)
    return None


@pytest.mark.parametrize("path", ["megatron", "deepspeed"])
def test_fp16_scale_pinned_at_its_minimum_stops_the_run(tmp_path, path):
    # Scale 4, hysteresis 1: iterations 1 and 2 halve it to the minimum 1; 3, 4, 5 overflow at 1 -> stop at 5.
    flags = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length",
             "8", "--vocab-size", "32", "--make-vocab-size-divisible-by", "8", "--eval-iters", "0", "--log-interval",
             "100", "--batch-size", "2", "--train-iters", "8", "--max-skipped-steps-at-min-scale", "3"]
    save = tmp_path / "checkpoints"
    if path == "deepspeed":
        from tests.helpers import write_config
        flags += ["--deepspeed", "--deepspeed_config", write_config(str(tmp_path), fp16={
            "enabled": True, "loss_scale": 0, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1})]
    else:
        flags += ["--fp16", "--initial-loss-scale", "4", "--hysteresis", "1", "--min-scale", "1",
                  "--save", str(save), "--save-interval", "4"]
    message = run_distributed(_train_overflowing_fp16, 1, args=(flags,))[0]
    assert message is not None, "the run did not stop"
    assert message.startswith("fp16 loss scale stuck at its minimum (1): iterations 3-5 all overflowed at that "
                              "scale and were skipped (lm loss="), message
    if path == "megatron":   # nothing saved at the stop: the tracker names the save of iteration 4
        assert "stopping without saving (the latest checkpoint stays iteration 4)" in message
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
