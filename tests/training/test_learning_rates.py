"""AnnealingLR against the schedule written out here independently (math.cos), point by point.

Schedule: max 6e-4, min 6e-5, warmup 10, decay ends at 110 (so the decay spans 100 steps and step 10 + 100 p is
progress p). Warmup is linear from 0 to max; after it, linear: min + (max - min)(1 - p); cosine:
min + (max - min)(1 + cos(pi p)) / 2; past the decay end: min; constant: max forever after warmup.
"""
import math

import pytest
import torch

from megatron.learning_rates import AnnealingLR

MAX, MIN, WARMUP, DECAY = 6e-4, 6e-5, 10, 110


def schedule(style, num_iters=0, **flags):
    return AnnealingLR(None, MAX, MIN, WARMUP, DECAY, style, num_iters=num_iters, **flags)


def lr_at(style, n):
    return schedule(style, num_iters=n).get_lr()


def expected(style, n):
    """The reference, by hand."""
    if n <= WARMUP:
        return MAX * n / WARMUP
    if style == "constant":
        return MAX
    if n > DECAY:
        return MIN
    p = (n - WARMUP) / (DECAY - WARMUP)
    if style == "linear":
        return MIN + (MAX - MIN) * (1 - p)
    return MIN + (MAX - MIN) * (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_warmup_is_linear_and_ends_exactly_at_max(style):
    assert lr_at(style, 0) == 0.0
    assert lr_at(style, 1) == pytest.approx(6e-5, rel=1e-12)         # 6e-4 * 1 / 10
    assert lr_at(style, 5) == pytest.approx(3e-4, rel=1e-12)
    assert lr_at(style, 9) == pytest.approx(5.4e-4, rel=1e-12)
    assert lr_at(style, WARMUP) == pytest.approx(MAX, rel=1e-12)     # the warmup's last step reaches max


def test_linear_decay_points():
    """By hand: p = 0.01 -> 6e-5 + 5.4e-4 * 0.99; p = 0.25 -> 4.65e-4; 0.5 -> 3.3e-4; 0.75 -> 1.95e-4; 1 -> min."""
    points = {11: 6e-5 + 5.4e-4 * 0.99, 35: 4.65e-4, 60: 3.3e-4, 85: 1.95e-4, DECAY: MIN}
    for n, value in points.items():
        assert lr_at("linear", n) == pytest.approx(value, rel=1e-12), n
        assert value == pytest.approx(expected("linear", n), rel=1e-12)


def test_cosine_decay_points():
    """By hand: p = 0.25 -> min + 5.4e-4 (1 + cos(pi/4)) / 2 = 5.2092e-4; 0.5 -> 3.3e-4 (the same as linear at
    the middle: the quarter points tell them apart); 0.75 -> 1.3908e-4; 1 -> min."""
    quarter = 6e-5 + 5.4e-4 * (1 + math.sqrt(0.5)) / 2
    three_quarters = 6e-5 + 5.4e-4 * (1 - math.sqrt(0.5)) / 2
    assert quarter == pytest.approx(5.2092e-4, abs=1e-8) and three_quarters == pytest.approx(1.3908e-4, abs=1e-8)
    points = {35: quarter, 60: 3.3e-4, 85: three_quarters, DECAY: MIN}
    for n, value in points.items():
        assert lr_at("cosine", n) == pytest.approx(value, rel=1e-12), n


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_every_step_matches_the_reference_and_never_falls_below_min(style):
    lrs = [lr_at(style, n) for n in range(0, 3 * DECAY)]
    for n, lr in enumerate(lrs):
        assert lr == pytest.approx(expected(style, n), rel=1e-12, abs=1e-18), n
    assert min(lrs[WARMUP:]) == pytest.approx(MIN, rel=1e-12)
    assert all(a >= b for a, b in zip(lrs[WARMUP:], lrs[WARMUP + 1:]))         # non-increasing after warmup


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_beyond_the_decay_end_is_min(style):
    for n in (DECAY + 1, DECAY + 50, 10 * DECAY):
        assert lr_at(style, n) == MIN


def test_constant_keeps_max_after_warmup_and_beyond_the_decay_end():
    for n in (WARMUP + 1, 60, DECAY, DECAY + 1, 10 * DECAY):
        assert lr_at("constant", n) == MAX


def test_without_warmup_step_zero_is_max():
    assert AnnealingLR(None, MAX, MIN, 0, 100, "linear").get_lr() == MAX
    assert AnnealingLR(None, MAX, MIN, 0, 100, "linear", num_iters=50).get_lr() == pytest.approx(3.3e-4, rel=1e-12)


def test_unknown_style_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown lr decay style 'exponential'.*'constant', 'linear', 'cosine'"):
        schedule("exponential")


def test_step_sets_every_param_group_of_the_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 1.0}], lr=1.0)
    scheduler = AnnealingLR(optimizer, MAX, MIN, WARMUP, DECAY, "linear")
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]              # applied at construction
    scheduler.step()
    assert scheduler.num_iters == 1
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([6e-5, 6e-5], rel=1e-12)
    scheduler.step(60)
    assert scheduler.num_iters == 60
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([3.3e-4, 3.3e-4], rel=1e-12)


def _saved(num_iters=37, **shape):
    args = dict(max_lr=MAX, min_lr=MIN, warmup_iter=WARMUP, decay_iters=DECAY, decay_style="cosine", **shape)
    source = AnnealingLR(None, num_iters=0, **args)
    for _ in range(num_iters):
        source.step()
    return source.state_dict()


def test_state_dict_round_trip_resumes_on_the_same_curve():
    state = _saved()
    assert state == {"max_lr": MAX, "min_lr": MIN, "warmup_iter": WARMUP, "decay_iters": DECAY,
                     "decay_style": "cosine", "num_iters": 37}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = AnnealingLR(optimizer, MAX, MIN, WARMUP, DECAY, "cosine")
    resumed.load_state_dict(state)
    assert resumed.num_iters == 37
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected("cosine", 37), rel=1e-12)
    resumed.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected("cosine", 38), rel=1e-12)


@pytest.mark.parametrize("key, ours", [("max_lr", 1e-3), ("min_lr", 0.0), ("warmup_iter", 5),
                                       ("decay_iters", 200), ("decay_style", "linear")])
def test_disagreeing_shape_without_a_flag_is_an_error_naming_the_field(key, ours):
    args = dict(max_lr=MAX, min_lr=MIN, warmup_iter=WARMUP, decay_iters=DECAY, decay_style="cosine")
    args[key] = ours
    with pytest.raises(ValueError, match=rf"lr scheduler {key}: command line .* != checkpoint .*"
                                         r"--use-checkpoint-lr-scheduler or --override-lr-scheduler"):
        AnnealingLR(None, **args).load_state_dict(_saved())


def test_use_checkpoint_lr_scheduler_takes_the_checkpoints_shape():
    """Command line: linear, max 1e-3, no warmup, decay over 50; the checkpoint's cosine curve wins."""
    resumed = AnnealingLR(None, 1e-3, 0.0, 0, 50, "linear", use_checkpoint_lr_scheduler=True)
    resumed.load_state_dict(_saved())
    assert (resumed.max_lr, resumed.min_lr, resumed.warmup_iter, resumed.decay_iters, resumed.decay_style) == \
        (MAX, MIN, WARMUP, DECAY, "cosine")
    assert resumed.num_iters == 37 and resumed.get_lr() == pytest.approx(expected("cosine", 37), rel=1e-12)


def test_override_lr_scheduler_keeps_the_command_lines_shape_and_the_checkpoints_step():
    """Command line: linear, max 1e-3, min 0, no warmup, decay over 74: at the checkpoint's step 37 that is
    1e-3 * (1 - 37/74) = 5e-4 (the checkpoint's own curve would give the cosine value)."""
    resumed = AnnealingLR(None, 1e-3, 0.0, 0, 74, "linear", override_lr_scheduler=True)
    resumed.load_state_dict(_saved())
    assert (resumed.max_lr, resumed.min_lr, resumed.warmup_iter, resumed.decay_iters, resumed.decay_style) == \
        (1e-3, 0.0, 0, 74, "linear")
    assert resumed.num_iters == 37 and resumed.get_lr() == pytest.approx(5e-4, rel=1e-12)


def test_override_wins_over_use_checkpoint_when_both_are_given():
    resumed = AnnealingLR(None, 1e-3, 0.0, 0, 74, "linear", override_lr_scheduler=True,
                          use_checkpoint_lr_scheduler=True)
    resumed.load_state_dict(_saved())
    assert resumed.get_lr() == pytest.approx(5e-4, rel=1e-12)


def test_a_larger_train_iters_relays_the_schedule_when_decay_follows_it():
    """No --lr-decay-iters: --train-iters 220 (warmup 0.01 x ... here 20) after a checkpoint of 110 at step 37 gives
    the cosine of a 220-iteration run at 37: min + (max - min)(1 + cos(pi (37 - 20) / 200)) / 2."""
    resumed = AnnealingLR(None, MAX, MIN, 20, 220, "cosine", follows_train_iters=True)
    resumed.load_state_dict(_saved())
    assert (resumed.warmup_iter, resumed.decay_iters, resumed.resumed_from_decay_iters) == (20, 220, DECAY)
    by_hand = MIN + (MAX - MIN) * (1 + math.cos(math.pi * 17 / 200)) / 2
    assert resumed.num_iters == 37 and resumed.get_lr() == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("key, ours", [("max_lr", 1e-3), ("min_lr", 0.0), ("decay_style", "linear")])
def test_a_relaid_schedule_still_refuses_every_other_disagreement(key, ours):
    args = dict(max_lr=MAX, min_lr=MIN, warmup_iter=20, decay_iters=220, decay_style="cosine")
    args[key] = ours
    with pytest.raises(ValueError, match=rf"lr scheduler {key}: command line"):
        AnnealingLR(None, follows_train_iters=True, **args).load_state_dict(_saved())


def test_a_warmup_change_at_the_same_train_iters_is_still_an_error():
    """decay_iters equal: the warmup differs because --warmup changed, which --train-iters does not explain."""
    with pytest.raises(ValueError, match=r"lr scheduler warmup_iter: command line 5 != checkpoint 10"):
        AnnealingLR(None, MAX, MIN, 5, DECAY, "cosine", follows_train_iters=True).load_state_dict(_saved())


def test_use_checkpoint_lr_scheduler_keeps_the_checkpoints_schedule_when_train_iters_grew():
    resumed = AnnealingLR(None, MAX, MIN, 20, 220, "cosine", follows_train_iters=True,
                          use_checkpoint_lr_scheduler=True)
    resumed.load_state_dict(_saved())
    assert (resumed.warmup_iter, resumed.decay_iters, resumed.resumed_from_decay_iters) == (WARMUP, DECAY, None)
