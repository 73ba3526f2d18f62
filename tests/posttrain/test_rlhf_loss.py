"""RLHF step 3's losses (megatron/posttrain/rlhf_loss.py), pure tensors:
- PPO (DeepSpeed-Chat's ppo_trainer.py): the per-token rewards with the clamped score where DeepSpeed-Chat's `ends`
  puts it (one past the answer, or its last token when the answer fills the row), GAE and returns, the clipped
  actor and critic losses, on 1x4 and 2x5 tensors worked out by hand below (masks and clipping active, gamma and
  lambda different, so a swap shows); TRL's advantage whitening.
- GRPO (TRL 1.16's GRPOTrainer): group advantages, and every loss reduction and the clip-ratio metrics against a
  transcription of TRL's _compute_loss on a fixed batch with unequal completion lengths, ratios on both sides of
  the clip range (epsilon != epsilon_high) and the k3 KL term on."""
import math

import pytest
import torch

from megatron.posttrain import rlhf_loss

F64 = dict(dtype=torch.float64)


def t(rows):
    return torch.tensor(rows, **F64)


def close(actual, expected, tol=1e-12):
    expected = torch.as_tensor(expected, **F64)
    assert torch.allclose(actual.to(torch.float64), expected, rtol=0, atol=tol), (actual, expected)


# ---- PPO: DeepSpeed-Chat's rewards, GAE, losses ------------------------------------------------------------------

def test_rewards_score_lands_where_deepspeed_chat_ends_puts_it_and_tails_are_zeroed():
    """L = 6 tokens, prompt of 2 (start = 1), 5 log-prob positions. Row 0: a 2-token answer then padding,
    ends = 1 + 2 + 1 = 4, the score on position 3 (the first padding token's); row 1 fills the row, ends = 6, the
    slice [1, 6) is cut at 5: the score on position 4, its last token. Scores 7 and -9 clamp to +-5."""
    action_mask = t([[1, 1, 1, 0, 0],
                     [1, 1, 1, 1, 1]])
    diff = t([[0.0, 1.0, -2.0, 3.0, 0.7],             # logp - ref
              [0.0, -1.0, 0.0, 2.0, 1.0]])
    ref = t([[-1.0] * 5, [-2.0] * 5])
    ends = rlhf_loss.response_ends(action_mask, 1)
    assert ends.tolist() == [4, 6]
    rewards = rlhf_loss.compute_rewards(ref + diff, ref, t([7.0, -9.0]), action_mask, start=1)
    close(rewards, [[-0.0, -0.1, 0.2, -0.3 + 5.0, -0.07],      # -0.1 x diff; +clamp(7) = 5 at position 3
                    [-0.0, 0.1, -0.0, -0.2, -0.1 - 5.0]])      # clamp(-9) = -5 at position 4
    values = t([[9.0, 1.0, 2.0, 0.5, 3.0],
                [9.0, 0.5, -1.0, 1.5, 2.0]])
    rewards, zeroed = rlhf_loss.zero_after_ends(rewards, values, ends)
    close(rewards[0], [-0.0, -0.1, 0.2, 4.7, 0.0])            # position 4 >= ends 4: zeroed
    close(zeroed, [[9.0, 1.0, 2.0, 0.5, 0.0], [9.0, 0.5, -1.0, 1.5, 2.0]])
    assert values[0, 4] == 3.0                                # the inputs untouched


def test_gae_and_returns_1x4_default_gamma_lambda():
    """gamma 1, lambda 0.95, start 1 (position 0 ignored):
    t=3: delta = 1.0 + 0 - 2.0 = -1.0                     A3 = -1.0
    t=2: delta = 0.3 + 2.0 - (-0.5) = 2.8                 A2 = 2.8 + 0.95 x (-1.0) = 1.85
    t=1: delta = -0.2 + (-0.5) - 1.0 = -1.7               A1 = -1.7 + 0.95 x 1.85 = 0.0575
    returns = A + V[1:] = 1.0575, 1.35, 1.0"""
    values, rewards = t([[0.5, 1.0, -0.5, 2.0]]), t([[9.0, -0.2, 0.3, 1.0]])
    advantages, returns = rlhf_loss.get_advantages_and_returns(values, rewards, start=1)
    close(advantages, [[0.0575, 1.85, -1.0]])
    close(returns, [[1.0575, 1.35, 1.0]])


def test_gae_and_returns_2x5_after_the_rewards():
    """The rewards and zeroed values of the first test, gamma 0.9, lambda 0.5 (gamma x lambda = 0.45), start 1.
    Row 0: r = -0.1, 0.2, 4.7, 0; V = 1.0, 2.0, 0.5, 0
      t=4: delta = 0                                       A = 0
      t=3: delta = 4.7 + 0.9 x 0 - 0.5 = 4.2               A = 4.2
      t=2: delta = 0.2 + 0.9 x 0.5 - 2.0 = -1.35           A = -1.35 + 0.45 x 4.2 = 0.54
      t=1: delta = -0.1 + 0.9 x 2.0 - 1.0 = 0.7            A = 0.7 + 0.45 x 0.54 = 0.943
    Row 1: r = 0.1, 0.0, -0.2, -5.1; V = 0.5, -1.0, 1.5, 2.0
      t=4: delta = -5.1 - 2.0 = -7.1                       A = -7.1
      t=3: delta = -0.2 + 0.9 x 2.0 - 1.5 = 0.1            A = 0.1 + 0.45 x (-7.1) = -3.095
      t=2: delta = 0.0 + 0.9 x 1.5 + 1.0 = 2.35            A = 2.35 + 0.45 x (-3.095) = 0.95725
      t=1: delta = 0.1 + 0.9 x (-1.0) - 0.5 = -1.3         A = -1.3 + 0.45 x 0.95725 = -0.8692375"""
    rewards = t([[-0.0, -0.1, 0.2, 4.7, 0.0], [-0.0, 0.1, -0.0, -0.2, -5.1]])
    values = t([[9.0, 1.0, 2.0, 0.5, 0.0], [9.0, 0.5, -1.0, 1.5, 2.0]])
    advantages, returns = rlhf_loss.get_advantages_and_returns(values, rewards, start=1, gamma=0.9, lam=0.5)
    close(advantages, [[0.943, 0.54, 4.2, 0.0], [-0.8692375, 0.95725, -3.095, -7.1]])
    close(returns, [[0.943 + 1.0, 0.54 + 2.0, 4.2 + 0.5, 0.0],
                    [-0.8692375 + 0.5, 0.95725 - 1.0, -3.095 + 1.5, -7.1 + 2.0]])


def test_whitened_advantages_over_the_mask():
    """Mask 1 on 1, 2, 3: mean 2, Bessel variance (1 + 0 + 1) / 2 = 1: -1, 0, 1; 0 where the mask is 0."""
    whitened = rlhf_loss.whiten_advantages(t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]]))
    close(whitened, [[-1.0, 0.0, 1.0, 0.0]], tol=1e-7)                     # rsqrt(1 + 1e-8)
    close(rlhf_loss.masked_whiten(t([1.0, 3.0]), t([1, 1]), shift_mean=False), [2.0 - 1 / math.sqrt(2),
                                                                              2.0 + 1 / math.sqrt(2)], tol=1e-7)


def _log_ratios(ratios):
    """(logprobs, old_logprobs) whose exp(difference) is `ratios` (old = -1)."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0, **F64)
    return old + torch.log(t(ratios)), old


def test_actor_loss_1x4_clipped_on_both_sides():
    """clip 0.2; mask 1, 1, 1, 0:
    ratio 1.5, A 2:   max(-3.0, -2 x 1.2 = -2.4)  = -2.4     (clipped above)
    ratio 0.5, A -1:  max(0.5, 1 x 0.8 = 0.8)     = 0.8      (clipped below)
    ratio 1.1, A 3:   max(-3.3, -3.3)             = -3.3
    masked (A 5):     left out                   loss = (-2.4 + 0.8 - 3.3) / 3"""
    logprobs, old = _log_ratios([[1.5, 0.5, 1.1, 2.0]])
    loss = rlhf_loss.actor_loss_fn(logprobs, old, t([[2.0, -1.0, 3.0, 5.0]]), t([[1, 1, 1, 0]]))
    close(loss, (-2.4 + 0.8 - 3.3) / 3)


def test_actor_loss_2x5():
    """Row 0 (mask 1, 1, 1, 0, 0; a masked log-ratio of 1000 with A -1 counts as 0, as DeepSpeed-Chat's (logp - old)
    x mask, where exp(1000) = inf would make the masked loss inf x 0 = NaN):
      1.25, A -1: max(1.25, 1.2) = 1.25;  0.7, A 2: max(-1.4, -1.6) = -1.4;  1.0, A 4: -4
    Row 1 (mask all 1):
      1.5, A 1: max(-1.5, -1.2) = -1.2;   0.5, A 1: max(-0.5, -0.8) = -0.5;  0.9, A -2: max(1.8, 1.8) = 1.8
      1.3, A -1: max(1.3, 1.2) = 1.3;     0.75, A 0.5: max(-0.375, -0.4) = -0.375
    loss = (1.25 - 1.4 - 4 - 1.2 - 0.5 + 1.8 + 1.3 - 0.375) / 8 = -3.125 / 8"""
    logprobs, old = _log_ratios([[1.25, 0.7, 1.0, 1.0, 1.0], [1.5, 0.5, 0.9, 1.3, 0.75]])
    logprobs[0, 3] += 1000.0
    advantages = t([[-1.0, 2.0, 4.0, -1.0, -2.0], [1.0, 1.0, -2.0, -1.0, 0.5]])
    loss = rlhf_loss.actor_loss_fn(logprobs, old, advantages, t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    close(loss, -3.125 / 8)


def test_critic_loss_1x4():
    """value clip 0.2; mask 1, 1, 1, 0:
    old 1, v 1.5, R 2:    clipped 1.2: max((1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64) = 0.64
    old 0, v 0.1, R 1:    clipped 0.1: 0.81
    old -1, v -1.3, R -1: clipped -1.2: max(0.09, 0.04) = 0.09        (the unclipped error is the larger)
    masked (25 unclipped): left out                    loss = 0.5 x (0.64 + 0.81 + 0.09) / 3"""
    loss = rlhf_loss.critic_loss_fn(t([[1.5, 0.1, -1.3, 0.0]]), t([[1.0, 0.0, -1.0, 2.0]]),
                                    t([[2.0, 1.0, -1.0, 5.0]]), t([[1, 1, 1, 0]]))
    close(loss, 0.5 * (0.64 + 0.81 + 0.09) / 3)


def test_critic_loss_2x5():
    """Row 0 (mask 1, 1, 1, 0, 0): old 0, v 0.5, R 1: clipped 0.2: max(0.25, 0.64) = 0.64;
      old 1, v 0.9, R 0: 0.81;  old 2, v 1.0, R 2.5: clipped 1.8: max(2.25, 0.49) = 2.25
    Row 1 (old 1 everywhere): v 1.1, R 1: 0.01;  v 2.0, R 1: clipped 1.2: max(1, 0.04) = 1;
      v 0, R 1: clipped 0.8: max(1, 0.04) = 1;  v 1.25, R 3: clipped 1.2: max(3.0625, 3.24) = 3.24;
      v 0.7, R 0.5: clipped 0.8: max(0.04, 0.09) = 0.09
    loss = 0.5 x (0.64 + 0.81 + 2.25 + 0.01 + 1 + 1 + 3.24 + 0.09) / 8 = 0.5 x 9.04 / 8"""
    values = t([[0.5, 0.9, 1.0, 3.0, 3.0], [1.1, 2.0, 0.0, 1.25, 0.7]])
    old = t([[0.0, 1.0, 2.0, 0.0, 0.0], [1.0] * 5])
    returns = t([[1.0, 0.0, 2.5, 0.0, 0.0], [1.0, 1.0, 1.0, 3.0, 0.5]])
    loss = rlhf_loss.critic_loss_fn(values, old, returns, t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    close(loss, 0.5 * 9.04 / 8)


def _deepspeed_chat_step(prompt_length, log_probs, ref_log_probs, reward_score, values, attention_mask):
    """DeepSpeed-Chat's DeepSpeedPPOTrainer.compute_rewards, train_rlhf's zeroing and get_advantages_and_returns,
    transcribed (its loops and in-place edits, defaults kl_ctl 0.1, reward clip 5, gamma 1, lambda 0.95)."""
    start = prompt_length - 1
    action_mask = attention_mask[:, 1:]
    rewards = -0.1 * (log_probs - ref_log_probs)
    ends = start + action_mask[:, start:].sum(1) + 1
    reward_clip = torch.clamp(reward_score, -5, 5)
    for j in range(log_probs.shape[0]):
        rewards[j, start:ends[j]][-1] += reward_clip[j]
    values = values.clone()
    for i in range(rewards.shape[0]):
        rewards[i, ends[i]:] = 0
        values[i, ends[i]:] = 0
    lastgaelam, advantages_reversed, length = 0, [], rewards.size()[-1]
    for t in reversed(range(start, length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + 1.0 * nextvalues - values[:, t]
        lastgaelam = delta + 1.0 * 0.95 * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return rewards, values, advantages, advantages + values[:, start:]


def test_ppo_experience_bitwise_deepspeed_chats_loops():
    """20 random batches of 3 rows, answers of 1 to 8 tokens in rows of 12 (some fill the row): rewards, zeroed
    values, advantages and returns bitwise DeepSpeed-Chat's."""
    generator = torch.Generator().manual_seed(1)
    prompt_length, width = 4, 12
    for _ in range(20):
        lengths = torch.randint(1, width - prompt_length + 1, (3,), generator=generator)
        attention_mask = (torch.arange(width)[None, :] < prompt_length + lengths[:, None]).long()
        log_probs, ref, values = (torch.randn(3, width - 1, generator=generator) for _ in range(3))
        score = torch.randn(3, generator=generator) * 8
        expected = _deepspeed_chat_step(prompt_length, log_probs, ref, score, values, attention_mask)
        start, action_mask = prompt_length - 1, attention_mask[:, 1:]
        rewards = rlhf_loss.compute_rewards(log_probs, ref, score, action_mask, start)
        rewards, zeroed = rlhf_loss.zero_after_ends(rewards, values, rlhf_loss.response_ends(action_mask, start))
        ours = (rewards, zeroed) + rlhf_loss.get_advantages_and_returns(zeroed, rewards, start)
        assert all(torch.equal(a, b) for a, b in zip(ours, expected))


# ---- GRPO: TRL 1.16 --------------------------------------------------------------------------------------------

def test_group_advantages():
    """Two prompts x 3 generations. group: (r - group mean) / (group std (Bessel) + 1e-4); batch: the std of all
    six; none: r - group mean. A NaN reward (unscorable) is out of the statistics and gets 0."""
    rewards = t([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])              # means 3 and 1; stds sqrt(7) and sqrt(3)
    expected = {"group": [-2 / (7 ** 0.5 + 1e-4), -1 / (7 ** 0.5 + 1e-4), 3 / (7 ** 0.5 + 1e-4),
                          -1 / (3 ** 0.5 + 1e-4), -1 / (3 ** 0.5 + 1e-4), 2 / (3 ** 0.5 + 1e-4)],
                # all six: mean 2, squares 1 + 0 + 16 + 4 + 4 + 1 = 26, variance 26 / 5
                "batch": [d / ((26 / 5) ** 0.5 + 1e-4) for d in (-2, -1, 3, -1, -1, 2)],
                "none": [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]}
    for scale, values in expected.items():
        close(rlhf_loss.group_advantages(rewards, 3, scale), values)
    with_nan = rlhf_loss.group_advantages(t([1.0, float("nan"), 3.0]), 3)   # mean 2, std sqrt(2)
    close(with_nan, [-1 / (2 ** 0.5 + 1e-4), 0.0, 1 / (2 ** 0.5 + 1e-4)])


EPSILON, EPSILON_HIGH, BETA, MAX_COMPLETION = 0.2, 0.28, 0.04, 6


def _batch():
    """4 completions (2 prompts x 2 generations) of lengths 5, 2, 4, 1 in a [4, 5] batch, ratios in [0.6, 1.65]:
    of the 12 tokens 3 clip above (A > 0; 2 more are above with A < 0), 3 below (A < 0; none with A > 0), and 2
    lie between 1 + epsilon and 1 + epsilon_high (A > 0), 2 between 1 - epsilon_high and 1 - epsilon (A < 0)."""
    generator = torch.Generator().manual_seed(8)
    old = -torch.rand(4, 5, generator=generator, **F64) * 3
    logps = old + (torch.rand(4, 5, generator=generator, **F64) - 0.5)
    ref = old + (torch.rand(4, 5, generator=generator, **F64) - 0.5) * 0.4
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1])[:, None]).to(torch.float64)
    advantages = rlhf_loss.group_advantages(t([1.0, 0.0, 0.5, 2.0]), 2)              # +-0.707
    return logps, old, ref, mask, advantages


def test_the_grpo_batch_clips_where_its_docstring_says():
    logps, old, _, mask, advantages = _batch()
    ratio, positive, on = torch.exp(logps - old), advantages[:, None] > 0, mask.bool()

    def count(where):
        return int((where & on).sum())
    assert [count((ratio > 1 + EPSILON_HIGH) & positive), count((ratio > 1 + EPSILON_HIGH) & ~positive)] == [3, 2]
    assert [count((ratio < 1 - EPSILON) & ~positive), count((ratio < 1 - EPSILON) & positive)] == [3, 0]
    between = (ratio > 1 + EPSILON) & (ratio < 1 + EPSILON_HIGH), (ratio > 1 - EPSILON_HIGH) & (ratio < 1 - EPSILON)
    assert [count(between[0] & positive), count(between[1] & ~positive)] == [2, 2]
    assert 0.6 < ratio[on].min() and ratio[on].max() < 1.65 and mask.sum(-1).tolist() == [5, 2, 4, 1]


def _trl_compute_loss(logps, old, ref, mask, advantages, loss_type, num_items_in_batch, num_processes,
                      gradient_accumulation_steps):
    """TRL 1.16 GRPOTrainer._compute_loss, token level, train mode, steps_per_generation = gradient accumulation
    steps (its default), transcribed: (the loss it returns, its metrics)."""
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(logps - old)
    per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON_HIGH)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages) + BETA * per_token_kl
    normalizer = gradient_accumulation_steps
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / normalizer
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / normalizer
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_COMPLETION) / normalizer
    else:   # dapo
        steps_per_generation = gradient_accumulation_steps
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer

    def global_masked_mean(x):
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    is_low = (coef_1 < 1 - EPSILON) & (advantages < 0)
    is_high = (coef_1 > 1 + EPSILON_HIGH) & (advantages > 0)
    metrics = {"kl": global_masked_mean(per_token_kl), "clip_ratio/low_mean": global_masked_mean(is_low.float()),
               "clip_ratio/high_mean": global_masked_mean(is_high.float()),
               "clip_ratio/region_mean": global_masked_mean((is_low | is_high).float())}
    return loss, metrics


def _ours(logps, old, ref, mask, advantages, loss_type, **split):
    per_token_loss, ratio, kl = rlhf_loss.grpo_per_token_loss(logps, old, advantages, EPSILON, EPSILON_HIGH, BETA,
                                                              ref)
    loss = rlhf_loss.grpo_loss(per_token_loss, mask, loss_type, MAX_COMPLETION, **split)
    reported = rlhf_loss.grpo_metrics(ratio, advantages, mask, EPSILON, EPSILON_HIGH, kl)
    return loss, {name: total / count for name, (total, count) in reported.items()}


@pytest.mark.parametrize("loss_type", rlhf_loss.LOSS_TYPES)
def test_grpo_reductions_and_metrics_equal_trl(loss_type):
    """The whole batch in one step (TRL: one process, no accumulation), then split in two micro-batches of
    unequal token counts (7 and 5; TRL: gradient accumulation 2, num_items_in_batch the 12 tokens): ours is the
    value TRL returns times its accumulation steps (it divides grpo/bnpo/dr_grpo by them, our loop averages)."""
    logps, old, ref, mask, advantages = _batch()
    loss, metrics = _ours(logps, old, ref, mask, advantages, loss_type)
    expected, trl_metrics = _trl_compute_loss(logps, old, ref, mask, advantages, loss_type, mask.sum(), 1, 1)
    close(loss, expected)
    assert metrics.keys() == trl_metrics.keys()
    for name, value in trl_metrics.items():
        close(metrics[name], value)
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0   # both sides clip
    for rows in ([0, 1], [2, 3]):
        piece = [x[rows] for x in (logps, old, ref, mask, advantages)]
        loss, metrics = _ours(*piece, loss_type, num_items_in_batch=mask.sum(), micro_batches=2)
        expected, trl_metrics = _trl_compute_loss(*piece, loss_type, mask.sum(), 1, 2)
        close(loss, 2 * expected)
        for name, value in trl_metrics.items():
            close(metrics[name], value)


def test_grpo_reductions_differ_on_unequal_lengths():
    """On this batch the four reductions are four different numbers (a reduction swapped for another shows)."""
    logps, old, ref, mask, advantages = _batch()
    losses = [_ours(logps, old, ref, mask, advantages, kind)[0].item() for kind in rlhf_loss.LOSS_TYPES[:3]]
    losses.append(_ours(logps, old, ref, mask, advantages, "dapo", num_items_in_batch=20)[0].item())
    assert len({round(x, 9) for x in losses}) == 4, losses


def test_grpo_without_kl_and_bad_names():
    logps, old, _, mask, advantages = _batch()
    per_token_loss, ratio, kl = rlhf_loss.grpo_per_token_loss(logps, old, advantages)      # beta 0: no reference
    assert kl is None and "kl" not in rlhf_loss.grpo_metrics(ratio, advantages, mask)
    clipped = torch.clamp(ratio, 0.8, 1.2)                                                  # epsilon_high = epsilon
    close(per_token_loss, -torch.min(ratio * advantages[:, None], clipped * advantages[:, None]))
    with pytest.raises(ValueError, match="loss_type 'sum'"):
        rlhf_loss.grpo_loss(per_token_loss, mask, "sum")
    with pytest.raises(ValueError, match="max_completion_length"):
        rlhf_loss.grpo_loss(per_token_loss, mask, "dr_grpo")
    with pytest.raises(ValueError, match="scale_rewards 'std'"):
        rlhf_loss.group_advantages(t([1.0, 2.0]), 2, "std")
