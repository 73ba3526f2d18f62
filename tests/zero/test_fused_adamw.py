"""The fused AdamW kernel: chosen where torch runs it (Megatron's get_optimizer and the engine's JSON optimizer),
off where it does not, and training with it equals torch's default kernel within fp32 rounding."""
import torch

from megatron import zero
from megatron.spawn import run_distributed
from megatron.zero.builder import adam_kernel_options
from tests.helpers import batch, max_relative_difference, NO_DROPOUT, TINY, TinyNet

STEPS, TOLERANCE = 10, 1e-5


def test_kernel_probe_falls_back_where_fused_is_missing():
    assert adam_kernel_options(torch.device("cpu")) == {"fused": True}      # torch >= 2.4 has a CPU fused Adam
    assert adam_kernel_options(torch.device("cpu"), torch.complex64) == {"foreach": True}   # fused: real only
    assert adam_kernel_options(torch.device("cpu"), torch.int64) == {}       # no Adam kernel at all


def _engine_run(optimizer_params, bf16=False):
    """STEPS single-process engine steps (stage 2) with the JSON optimizer; (losses, state, param group)."""
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, **optimizer_params}}}
    engine, optimizer, _, _ = zero.initialize(model=TinyNet(), config=config, dist_init_required=False)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 4)
        loss = engine(x.to(engine.module.fc1.weight.dtype), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, optimizer.param_groups[0]


def test_engine_json_optimizer_is_fused_and_equals_torch_adam():
    fused_losses, fused_state, fused_group = _engine_run({})
    torch_losses, torch_state, torch_group = _engine_run({"torch_adam": True})
    assert fused_group["fused"] is True and not torch_group.get("fused")
    assert max_relative_difference(fused_losses, torch_losses) <= TOLERANCE
    assert max_relative_difference(fused_state, torch_state) <= TOLERANCE
    assert fused_losses[-1] < fused_losses[0]


def test_engine_bf16_steps_fp32_masters_with_the_fused_kernel():
    fused_losses, fused_state, group = _engine_run({}, bf16=True)
    torch_losses, torch_state, _ = _engine_run({"torch_adam": True}, bf16=True)
    assert group["fused"] is True and group["params"][0].dtype == torch.float32
    assert max_relative_difference(fused_losses, torch_losses) <= 1e-3      # bf16 rounding of the parameters
    assert max_relative_difference(fused_state, torch_state) <= 1e-2


def _megatron_kernel_choices(extras):
    """(fused, foreach) of get_optimizer's AdamW under each list of extra flags."""
    from megatron import training
    from megatron.arguments import parse_args
    from megatron.global_vars import set_global_variables
    choices = []
    for extra in extras:
        set_global_variables(parse_args(args_list=TINY + extra))
        group = training.get_optimizer(torch.nn.Linear(4, 4)).param_groups[0]
        choices.append((bool(group.get("fused")), bool(group.get("foreach"))))
    return choices


def _megatron_losses(extras):
    """The losses of one pretrain_gpt run per list of extra flags, one after the other in this process."""
    import pretrain_gpt
    return [pretrain_gpt.main(TINY + NO_DROPOUT + ["--batch-size", "2"] + extra)["lm loss"] for extra in extras]


def test_megatron_get_optimizer_is_fused_unless_turned_off():
    choices = run_distributed(_megatron_kernel_choices, 1, args=([[], ["--no-fused-adam"]],))[0]
    assert choices == [(True, False), (False, False)]


def test_megatron_training_with_fused_adam_equals_the_default_kernel():
    fused, default = run_distributed(_megatron_losses, 1, args=([[], ["--no-fused-adam"]],))[0]
    assert len(fused) == len(default) == 10
    assert max(abs(a - b) for a, b in zip(fused, default)) <= TOLERANCE, (fused, default)
    assert fused[-1] < fused[0]
