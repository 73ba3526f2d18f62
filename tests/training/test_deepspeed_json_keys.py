"""Every key DeepSpeed 0.19.8 documents for the JSON "optimizer" (Adam, AdamW, Muon) and "scheduler" (WarmupLR,
WarmupDecayLR) blocks, through pretrain_gpt.py --deepspeed: honoured (the optimizer's param groups and the schedule's
learning rates hold what DeepSpeed's would: hand-computed from its documented formulas) or refused in one line naming
the key; a flag that disagrees with a key is refused naming both. One real run: Muon's weight_decay changes the loss.
"""
import math

import pytest

from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, parser_error, TINY, train_each, write_config

DS = ["--deepspeed", "--deepspeed_config"]


def _setups(argv_lists):
    """For each argument list, setup_model_and_optimizer as pretrain_gpt.py runs it: (the optimizer class, its param
    groups' settings, each group's lr at the start and after each of 4 scheduler steps)."""
    import mpu
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    results = []
    for argv in argv_lists:
        initialize_megatron(args_list=argv)
        _, optimizer, scheduler, _ = setup_model_and_optimizer(pretrain_gpt.model_provider)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        lrs = []
        for _ in range(5):
            lrs.append([g["lr"] for g in optimizer.param_groups])
            scheduler.step()
        results.append((type(optimizer.optimizer).__name__, groups, lrs))
        mpu.destroy_model_parallel()
    return results


def _config(tmp_path, name, **blocks):
    directory = tmp_path / name
    directory.mkdir()
    return write_config(str(directory), **blocks)


def _argv(config, *flags, schedule=False):
    """TINY's flags (less its --warmup 0, a Megatron schedule flag, beside a JSON scheduler), `flags`, the JSON."""
    tiny = [a for i, a in enumerate(TINY) if not schedule or "--warmup" not in TINY[max(i - 1, 0):i + 1]]
    return tiny + NO_DROPOUT + list(flags) + DS + [config]


ADAMW = {"type": "AdamW", "params": {"lr": 0.004, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.3,
                                     "torch_adam": True}}
ADAM = {"type": "Adam", "params": {"lr": 0.002, "adam_w_mode": True, "bias_correction": True, "amsgrad": False,
                                   "torch_adam": False}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "momentum": 0.9, "ns_method": "gram",
                                   "weight_decay": 0.5, "betas": [0.5, 0.6], "eps": 1e-7}}
MUON_LR = {"type": "Muon", "params": {"lr": 0.003, "muon_lr": 0.05}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}
WARMUP_LOG = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 3,
                                             "last_batch_iteration": 0}}
DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                             "total_num_steps": 4, "warmup_type": "linear"}}


def test_every_documented_optimizer_and_scheduler_key_sets_the_run(tmp_path):
    argv = [_argv(_config(tmp_path, name, optimizer=optimizer, **({"scheduler": scheduler} if scheduler else {})),
                  schedule=scheduler is not None)
            for name, optimizer, scheduler in (("adamw", ADAMW, None), ("adam", ADAM, WARMUP),
                                               ("muon", MUON, WARMUP_LOG), ("muon_lr", MUON_LR, DECAY))]
    (adamw, adam, muon, muon_lr), = run_distributed(_setups, 1, args=(argv,))
    # AdamW: Megatron's groups (biases and norms undecayed), every key's value; torch_adam: torch's default kernel
    kind, (decay, no_decay), lrs = adamw
    assert kind == "AdamW" and lrs[0] == [0.004, 0.004]
    for group in (decay, no_decay):
        assert (group["betas"], group["eps"], group["fused"]) == ((0.8, 0.9), 1e-6, None), group
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    # "Adam" with adam_w_mode true is AdamW (decoupled); torch_adam false: the fused kernel; WarmupLR linear
    kind, (decay, _), lrs = adam
    assert kind == "AdamW" and decay["fused"] is True and decay["weight_decay"] == 0.01   # --weight-decay's default
    assert [row[0] for row in lrs] == pytest.approx([0.001] + [0.001 + 0.009 * i / 4 for i in range(4)])
    # Muon: each half's keys (adam_lr the AdamW half's lr, lr Muon's when muon_lr is absent); WarmupLR log from
    # last_batch_iteration 0 (the constructor leaves --lr's, each step i sets gamma = log(i + 1) / log(3), then 1)
    kind, groups, lrs = muon
    muon_half, adam_half = [g for g in groups if g["use_muon"]], [g for g in groups if not g["use_muon"]]
    assert kind == "Muon" and len(muon_half) == 1 and len(adam_half) == 2
    assert (muon_half[0]["momentum"], muon_half[0]["ns_method"], muon_half[0]["weight_decay"]) == (0.9, "gram", 0.5)
    for group in adam_half:
        assert (group["betas"], group["eps"]) == ((0.5, 0.6), 1e-7), group
    assert sorted(g["weight_decay"] for g in adam_half) == [0.0, 0.5]
    assert muon_half[0]["lr_mult"] == pytest.approx(0.02 / 0.003)
    adam_index = groups.index(adam_half[0])
    assert [row[adam_index] for row in lrs] == pytest.approx([0.003, 0.02 * math.log(2) / math.log(3), 0.02, 0.02,
                                                              0.02])
    # muon_lr over lr; WarmupDecayLR linear: up over 2 steps, then down to 0 at total_num_steps 4
    kind, groups, lrs = muon_lr
    muon_index = next(i for i, g in enumerate(groups) if g["use_muon"])
    adam_index = next(i for i, g in enumerate(groups) if not g["use_muon"])
    assert groups[muon_index]["lr_mult"] == pytest.approx(0.05 / 0.003)
    expected = [0.0, 0.0, 0.005, 0.01, 0.005]
    assert [row[adam_index] for row in lrs] == pytest.approx(expected)
    assert [row[muon_index] for row in lrs] == pytest.approx([lr * 0.05 / 0.003 for lr in expected])


REFUSED = [  # (optimizer block, scheduler block, flags, what the one line names)
    ({"type": "Adam", "params": {"adam_w_mode": False}}, None, [], ["optimizer.params.adam_w_mode"]),
    ({"type": "AdamW", "params": {"amsgrad": True}}, None, [], ["optimizer.params.amsgrad"]),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, None, [], ["optimizer.params.max_grad_norm"]),
    ({"type": "AdamW", "params": {"bias_correction": False}}, None, [], ["optimizer.params.bias_correction"]),
    ({"type": "Muon", "params": {"torch_adam": True}}, None, [], ["optimizer.params.torch_adam"]),
    ({"type": "Muon", "params": {"per_head_muon": True}}, None, [], ["optimizer.params.per_head_muon"]),
    ({"type": "Muon", "params": {"ns_method": "quintic"}}, None, [], ["optimizer.params.ns_method"]),
    ({"type": "Lamb"}, None, [], ["optimizer.type", "Lamb"]),
    (ADAMW, None, ["--weight-decay", "0.1"], ["--weight-decay (0.1)", "optimizer.params.weight_decay (0.3)"]),
    (ADAMW, None, ["--adam-beta2", "0.95"], ["--adam-beta2 (0.95)", "optimizer.params.betas[1] (0.9)"]),
    (ADAMW, None, ["--adam-eps", "1e-5"], ["--adam-eps (1e-05)", "optimizer.params.eps (1e-06)"]),
    (ADAMW, None, ["--no-fused-adam"], []),     # torch_adam true agrees: accepted
    (ADAM, None, ["--no-fused-adam"], ["--no-fused-adam", "optimizer.params.torch_adam"]),
    (MUON, None, ["--muon-momentum", "0.8"], ["--muon-momentum (0.8)", "optimizer.params.momentum (0.9)"]),
    (None, {"type": "WarmupCosineLR", "params": {}}, [], ["scheduler.type", "WarmupCosineLR"]),
    (None, {"type": "OneCycle", "params": {}}, [], ["scheduler.type", "OneCycle"]),
    (None, {"type": "WarmupLR", "params": {"cycle_momentum": True}}, [], ["cycle_momentum"]),
    (None, WARMUP, ["--lr-decay-style", "cosine"], ["--lr-decay-style (cosine)", "WarmupLR"]),
    (None, WARMUP, ["--min-lr", "1e-5"], ["--min-lr (1e-05)", "WarmupLR"]),
    (None, WARMUP, ["--lr-decay-iters", "5"], ["--lr-decay-iters (5)", "WarmupLR"]),
    (None, WARMUP, ["--lr", "0.02"], ["--lr (0.02)", "scheduler.params.warmup_max_lr (0.01)"]),
    (None, WARMUP, ["--lr", "0.01"], []),        # the peak: accepted
]


@pytest.mark.parametrize("optimizer,scheduler,flags,named", REFUSED)
def test_a_key_the_run_cannot_honour_or_a_disagreeing_flag_is_refused_by_name(tmp_path, capsys, optimizer,
                                                                               scheduler, flags, named):
    from megatron.arguments import parse_args
    blocks = {key: block for key, block in (("optimizer", optimizer), ("scheduler", scheduler)) if block}
    config = write_config(str(tmp_path), **blocks)
    argv = ["--mock-data"] + flags + DS + [config]
    if not named:
        parse_args(args_list=argv)
        return
    line = parser_error(lambda a: parse_args(args_list=a), argv, capsys)
    for part in named:
        assert part in line, (part, line)


def test_muon_weight_decay_from_the_json_changes_the_loss(tmp_path):
    """A real run: Muon with the JSON's weight_decay 0.01 and 2.0 (DeepSpeed applies it to both halves) train
    different losses after the first step (the issue: they were equal to every digit)."""
    argv = []
    for decay in (0.01, 2.0):
        muon = {"type": "Muon", "params": {"lr": 0.05, "adam_lr": 0.01, "weight_decay": decay}}
        argv.append(_argv(_config(tmp_path, f"wd{decay}", optimizer=muon), "--train-iters", "3"))
    (low, high), = run_distributed(train_each, 1, args=(argv,))
    assert low["lm loss"][0] == high["lm loss"][0]                  # the same start
    # measured 9.0e-4 apart at step 3 (dropped, the key left them equal to every digit)
    assert abs(low["lm loss"][-1] - high["lm loss"][-1]) > 2e-4, (low["lm loss"], high["lm loss"])
