"""LossScaler, the fp16 loss-scale state machine, step by step against hand-computed sequences (no training).

Each sequence is a list of (found_inf, scale after the update); the expected scales are worked out by hand from
the rules in loss_scaler.py's docstring (DeepSpeed's semantics), not by running the class.
"""
import pytest

from megatron.fp16.loss_scaler import LossScaler, LossScalerConfig

F, T = False, True     # found_inf: clean step, overflow


def dynamic(power, window, hysteresis=1, min_scale=1.0):
    return LossScaler(LossScalerConfig(loss_scale=0, initial_scale_power=power, loss_scale_window=window,
                                       hysteresis=hysteresis, min_loss_scale=min_scale))


def run(scaler, trace):
    """Feed `trace`'s overflow flags; check what each update returns (skip iff overflow) and the scale after it."""
    scales = []
    for found_inf, _ in trace:
        assert scaler.update(found_inf) is found_inf
        scales.append(scaler.cur_scale)
    assert scales == [scale for _, scale in trace]


def test_docstring_trace():
    """The module docstring's example: initial 2**4, window 2, hysteresis 2."""
    run(dynamic(4, window=2, hysteresis=2), [(F, 16), (F, 32), (T, 32), (T, 16), (F, 16), (F, 32)])


def test_initial_scale_is_two_to_the_power():
    assert dynamic(16, window=1000).cur_scale == 65536.0
    assert dynamic(0, window=1000).cur_scale == 1.0


def test_growth_exactly_after_window_clean_steps_from_the_start():
    """Window 3: the 3rd clean step doubles (not the 2nd, not the 4th), then every 3rd after it."""
    run(dynamic(0, window=3), [(F, 1), (F, 1), (F, 2), (F, 2), (F, 2), (F, 4), (F, 4)])


def test_growth_exactly_after_window_clean_steps_after_an_overflow():
    """Window 3, hysteresis 1: the overflow halves 16 -> 8 and restarts the count; the 3rd clean step after it
    doubles. An overflow one step before the window would have completed also restarts the count."""
    run(dynamic(4, window=3), [(F, 16), (T, 8), (F, 8), (F, 8), (F, 16),
                               (F, 16), (T, 8), (F, 8), (F, 8), (F, 16)])


def test_window_one_doubles_every_clean_step():
    run(dynamic(2, window=1), [(F, 8), (F, 16), (T, 8), (F, 16)])


def test_hysteresis_one_halves_on_every_overflow():
    run(dynamic(4, window=100), [(T, 8), (T, 4), (F, 4), (T, 2)])


def test_hysteresis_delays_the_first_halving_and_only_growth_refills_it():
    """Hysteresis 3, window 100 (no growth here): overflows 1 and 2 keep 16, the 3rd halves; the budget stays
    spent (a clean step does not refill it), so each later overflow halves at once."""
    run(dynamic(4, window=100, hysteresis=3), [(T, 16), (T, 16), (T, 8), (F, 8), (T, 4), (T, 2)])


def test_growth_refills_the_hysteresis_budget():
    """Hysteresis 3, window 2: after the halving, two clean steps double the scale and refill the budget to 3,
    so it again takes three overflows to halve."""
    run(dynamic(4, window=2, hysteresis=3), [(T, 16), (T, 16), (T, 8), (F, 8), (F, 16),
                                             (T, 16), (T, 16), (T, 8)])


def test_min_scale_is_a_floor():
    run(dynamic(2, window=100), [(T, 2), (T, 1), (T, 1), (T, 1)])
    run(dynamic(2, window=100, min_scale=3.0), [(T, 3), (T, 3)])      # 4 / 2 = 2 < 3: clamped
    run(dynamic(3, window=2, min_scale=0.25), [(T, 4), (T, 2), (T, 1), (T, 0.5), (T, 0.25), (T, 0.25)])


@pytest.mark.parametrize("trace", [[(F, 128.0)] * 5, [(T, 128.0), (T, 128.0), (F, 128.0), (T, 128.0)]])
def test_static_scale_never_changes(trace):
    """loss_scale > 0 is static: no growth after any number of clean steps, no backoff, but overflows still
    skip the step."""
    scaler = LossScaler(LossScalerConfig(loss_scale=128, initial_scale_power=4, loss_scale_window=1,
                                         hysteresis=1, min_loss_scale=1))
    assert not scaler.dynamic and scaler.cur_scale == 128.0
    run(scaler, trace)


def test_state_dict_after_the_docstring_trace():
    """By hand: six updates; the last overflow at iteration 3; the growth at iteration 5 refilled the budget."""
    scaler = dynamic(4, window=2, hysteresis=2)
    for found_inf in (F, F, T, T, F, F):
        scaler.update(found_inf)
    assert scaler.state_dict() == {"scale": 32.0, "iteration": 6, "last_overflow_iteration": 3,
                                   "hysteresis_left": 2, "dynamic": True}


@pytest.mark.parametrize("split", range(1, 9))
def test_state_dict_round_trip_continues_the_same_sequence(split):
    """Save after `split` updates, load into a fresh scaler of the same config, continue: the scales equal the
    uninterrupted run's at every step (so the window position and the spent hysteresis budget travel)."""
    flags = [F, T, F, F, T, T, F, F, F, T, F]
    whole = dynamic(4, window=3, hysteresis=2)
    expected = []
    for found_inf in flags:
        whole.update(found_inf)
        expected.append(whole.cur_scale)
    first = dynamic(4, window=3, hysteresis=2)
    for found_inf in flags[:split]:
        first.update(found_inf)
    resumed = dynamic(10, window=3, hysteresis=2)        # another initial scale: the state must win
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    for found_inf, scale in zip(flags[split:], expected[split:]):
        resumed.update(found_inf)
        assert resumed.cur_scale == scale


def test_state_dict_round_trip_keeps_a_static_scale_static():
    static = LossScaler(LossScalerConfig(loss_scale=8))
    resumed = LossScaler(LossScalerConfig())                # dynamic 2**16 by default
    resumed.load_state_dict(static.state_dict())
    run(resumed, [(T, 8.0), (F, 8.0)])
