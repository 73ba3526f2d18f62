"""The engine's timers wait for the device only when asked (issue 53 row 4). DeepSpeed's keys: "wall_clock_breakdown"
(forward/backward/step timers) and "timers": {"throughput": {"enabled", "synchronized"}} (engine.tput_timer).

On the CPU there is nothing to wait for, so the engine is built on the CPU and its timers are then pointed at a
"cuda" device, with torch.cuda's availability and synchronize() mocked for the training steps only: every wait
either timer would make on a GPU is counted. The expected counts follow from the timers' rules by hand."""
import pytest
import torch

from tests.helpers import TinyNet, batch

STEPS = 6                          # optimizer steps, accumulation 1: the throughput timer times steps 3-6
TIMED = STEPS - 2                  # its warm-up: DeepSpeed's start_step 2
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 2}}


def _synchronizations(monkeypatch, **config):
    """torch.cuda.synchronize() calls during STEPS training steps of an engine built with `config` added."""
    from megatron import zero
    model = TinyNet()
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config={**CONFIG, **config})
    engine.timers.device = engine.tput_timer.device = torch.device("cuda")
    batches = [batch(step, 2) for step in range(STEPS)]      # made before CUDA is mocked
    calls = []
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        cuda.setattr(torch.cuda, "is_initialized", lambda: True)
        cuda.setattr(torch.cuda, "synchronize", lambda *device: calls.append(device))
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
    return len(calls), engine


def test_no_wait_unless_asked(monkeypatch):
    count, engine = _synchronizations(monkeypatch)
    assert count == 0
    assert engine.tput_timer.global_step_count == STEPS          # it still counts, untimed waits aside
    assert engine.tput_timer.avg_samples_per_sec() > 0


def test_wall_clock_breakdown_waits_at_every_timer(monkeypatch):
    """forward, backward and step: a wait at each start and stop; the throughput timer: at its timed starts and
    stops."""
    count, _ = _synchronizations(monkeypatch, wall_clock_breakdown=True)
    assert count == STEPS * 3 * 2 + TIMED * 2


@pytest.mark.parametrize("synchronized, expected", [(True, TIMED * 2), (False, 0)])
def test_the_throughput_timers_keys(monkeypatch, synchronized, expected):
    count, _ = _synchronizations(monkeypatch, timers={"throughput": {"synchronized": synchronized}})
    assert count == expected


def test_a_disabled_throughput_timer_neither_waits_nor_counts(monkeypatch):
    """DeepSpeed's "enabled": false: start() and stop() return at once, also under wall_clock_breakdown."""
    count, engine = _synchronizations(monkeypatch, wall_clock_breakdown=True,
                                      timers={"throughput": {"enabled": False, "synchronized": True}})
    assert count == STEPS * 3 * 2
    assert engine.tput_timer.global_step_count == 0 and engine.tput_timer.micro_step_count == 0


def test_the_timers_block_is_typed():
    from megatron.zero import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"timers.throughput.synchronized: expected bool, got str 'yes'"):
        load_config({**CONFIG, "timers": {"throughput": {"synchronized": "yes"}}})
    with pytest.raises(ConfigError, match="unknown key 'synchronised'.*did you mean 'synchronized'"):
        load_config({**CONFIG, "timers": {"throughput": {"synchronised": True}}})
