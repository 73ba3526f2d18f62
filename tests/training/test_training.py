"""The Megatron training loop: model/data-parallel runs equal a single process; fp16 loss scaling; bad flags."""
import os
import sys

import pytest
import torch

from megatron.spawn import run_distributed

from tests.helpers import NO_DROPOUT, REPO, TINY, train
from tests import warm_python


def _losses(world_size, extra):
    histories = run_distributed(train, world_size, args=(TINY + NO_DROPOUT + extra,))
    for history in histories[1:]:
        assert history["lm loss"] == histories[0]["lm loss"], "ranks disagree on the reduced loss"
    return histories[0]["lm loss"]


@pytest.fixture(scope="module")
def reference():
    """One process, micro batch 4, no accumulation."""
    return _losses(1, ["--batch-size", "4"])


@pytest.mark.parametrize("world_size,extra", [
    (2, ["--batch-size", "4", "--model-parallel-size", "2"]),
    (2, ["--batch-size", "2"]),
    (2, ["--batch-size", "2", "--DDP-impl", "torch"]),
    (4, ["--batch-size", "2", "--model-parallel-size", "2"]),
    (1, ["--batch-size", "2", "--global-batch-size", "4"]),
], ids=["mp2", "dp2-local", "dp2-torch", "mp2xdp2", "accumulation2"])
def test_parallel_training_equals_single_process(reference, world_size, extra):
    losses = _losses(world_size, extra)
    assert len(losses) == 10
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (losses, reference)
    assert losses[-1] < losses[0]


_POISONED_ITERATIONS = (2, 3)


_TRAINING_FORWARDS = [0]   # training forward steps of this process (one micro-batch per iteration in that test)


def _poisoned_forward_step(data_iterator, model):
    """The real forward step, with the loss made inf on chosen iterations (an fp16 overflow in every grad)."""
    import pretrain_gpt
    loss, reduced = pretrain_gpt.forward_step(data_iterator, model)
    if model.training:
        _TRAINING_FORWARDS[0] += 1
        if _TRAINING_FORWARDS[0] in _POISONED_ITERATIONS:
            loss = loss * float("inf")
    return loss, reduced


def _train_fp16(args_list):
    import pretrain_gpt
    from megatron.training import pretrain
    history = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                       _poisoned_forward_step, args_list=args_list)
    return history


def test_fp16_overflow_skips_and_scale_follows_hysteresis_and_window():
    args = TINY + ["--fp16", "--initial-loss-scale", "16", "--loss-scale-window", "3", "--hysteresis", "2",
                   "--train-iters", "8", "--warmup", "0.5", "--batch-size", "2"]
    history = run_distributed(_train_fp16, 2, args=(args,))[0]
    assert history["skipped"] == [0, 1, 1, 0, 0, 0, 0, 0]
    # hysteresis 2: the first overflow only spends the budget, the second halves; 3 clean steps double.
    assert history["loss scale"] == [16, 16, 8, 8, 8, 16, 16, 16]
    # skipped steps leave the lr schedule where it was (warmup over 4 iterations: lr = n/4 * max)
    lrs = history["lr"]
    assert lrs[0] == lrs[1] == lrs[2] and lrs[3] > lrs[2]
    # AnnealingLR by hand: --lr 1e-3, --min-lr 0, linear decay over --lr-decay-iters = --train-iters = 8,
    # warmup int(0.5 * 8) = 4 iterations. The scheduler starts at n = 0 and steps once per applied
    # iteration (skipped fp16 steps do not advance it); the lr logged for an iteration is the one after its step:
    #   n <= 4: lr = 1e-3 * n / 4;  n > 4: lr = 1e-3 * (1 - (n - 4) / (8 - 4))
    max_lr, warmup, decay = 1e-3, 4, 8
    expected, n = [], 0
    for skipped in [0, 1, 1, 0, 0, 0, 0, 0]:
        n += 1 - skipped
        expected.append(max_lr * n / warmup if n <= warmup else max_lr * (1 - (n - warmup) / (decay - warmup)))
    assert expected == pytest.approx([2.5e-4, 2.5e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 7.5e-4, 5e-4], rel=1e-12)
    assert lrs == pytest.approx(expected, rel=1e-12), lrs


def _fp16_optimizer_unit():
    """FP16_Optimizer alone: an inf grad leaves fp16 params, fp32 masters and Adam state untouched."""
    from megatron.fp16 import FP16_Optimizer, LossScaler, LossScalerConfig
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).half()
    optimizer = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                               LossScaler(LossScalerConfig(initial_scale_power=3, hysteresis=1)))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    optimizer.backward(model(torch.ones(2, 4, dtype=torch.half)).float().sum() * float("inf"))
    optimizer.update_master_grads()
    took = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scale_after_overflow = optimizer.loss_scale
    optimizer.zero_grad()
    optimizer.backward(model(torch.ones(2, 4, dtype=torch.half)).float().sum())
    optimizer.update_master_grads()
    took_clean = optimizer.step()
    changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"took": took, "unchanged": unchanged, "scale": scale_after_overflow,
            "took_clean": took_clean, "changed": changed,
            "master_dtypes": {str(m.dtype) for m in optimizer.master_params},
            "model_dtypes": {str(p.dtype) for p in model.parameters()}}


def test_fp16_optimizer_skip_and_fp32_masters():
    result = run_distributed(_fp16_optimizer_unit, 1, model_parallel_size=1)[0]
    assert result["took"] is False and result["unchanged"]
    assert result["scale"] == 4.0
    assert result["took_clean"] is True and result["changed"]
    assert result["master_dtypes"] == {"torch.float32"} and result["model_dtypes"] == {"torch.float16"}


def _exit_controller_after_foreign_sigterm_handler():
    """signal.signal() returns None when the previous SIGTERM handler was installed outside Python."""
    import signal
    from megatron.guards.exit_controller import ExitController
    real = signal.signal
    signal.signal = lambda signum, handler: (real(signum, handler), None)[1]
    try:
        controller = ExitController(exit_signal_handler=True)
    finally:
        signal.signal = real
    os.kill(os.getpid(), signal.SIGTERM)
    stopped = controller.should_exit(1), controller.reason
    controller.close()
    return stopped, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_exit_controller_with_foreign_previous_handler():
    (stopped, reason), restored = run_distributed(_exit_controller_after_foreign_sigterm_handler, 1,
                                                  model_parallel_size=1)[0]
    assert stopped and reason == "SIGTERM (--exit-signal-handler)"
    assert restored


@pytest.mark.parametrize("flags,env,message", [
    (["--hidden-size", "30", "--num-attention-heads", "4"], {}, "--hidden-size (30) is not divisible by --num-attention-heads (4)"),
    (["--num-attention-heads", "3", "--hidden-size", "48", "--model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     "--num-attention-heads (3) is not divisible by --model-parallel-size (2)"),
    (["--model-parallel-size", "2"], {"WORLD_SIZE": "3"}, "world size (3) is not divisible by --model-parallel-size (2)"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], {}, "--seq-length (64) is longer than --max-position-embeddings (32)"),
    (["--torch-compile"], {"CXX": "no-such-c++"}, "--torch-compile on the CPU needs a C++ compiler for inductor: "
     "'no-such-c++' (the CXX variable, default g++) is not on PATH"),
])
def test_invalid_configuration_exits_with_message(flags, env, message):
    result = warm_python.run([sys.executable, "pretrain_gpt.py", "--mock-data"] + flags, cwd=REPO,
                             env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
