"""The losses of RLHF step 3 (DESIGN.md section 12), pure functions of tensors (no model, no engine): PPO as
DeepSpeed-Chat computes it and GRPO as TRL 1.16 does.

PPO, DeepSpeed-Chat's DeepSpeedPPOTrainer (DeepSpeedExamples applications/DeepSpeed-Chat/dschat/rlhf/
ppo_trainer.py: compute_rewards, train_rlhf, get_advantages_and_returns, actor_loss_fn, critic_loss_fn), its
defaults KL_CTL, CLIP_REWARD_VALUE, CLIPRANGE, CLIPRANGE_VALUE, GAMMA, LAM:

    ends = response_ends(action_mask, start)
    rewards = compute_rewards(log_probs, ref_log_probs, reward_score, action_mask, start)   # [b, L - 1]
    rewards, values = zero_after_ends(rewards, values, ends)          # train_rlhf's loop, as new tensors
    advantages, returns = get_advantages_and_returns(values, rewards, start)              # [b, L - 1 - start]
    advantages = whiten_advantages(advantages, action_mask[:, start:])                    # optional (TRL's)
    actor_loss = actor_loss_fn(new_log_probs[:, start:], log_probs[:, start:], advantages, action_mask[:, start:])
    critic_loss = critic_loss_fn(new_values[:, start:], values[:, start:], returns, action_mask[:, start:])

The positions are DeepSpeed-Chat's: a row of L tokens (prompt of P, answer, right padding) gives L - 1 log-probs,
log_probs[:, t] = log p(seq[t + 1] | seq[:t + 1]), and values[:, t] the critic's value at seq[t];
action_mask = attention_mask[:, 1:] (1 where seq[t + 1] is not padding); start = P - 1 (the first answer token's
position). The reward score goes on the last position of rewards[j, start:ends[j]], ends = start + (answer tokens
not padding) + 1, which is one past the answer's last token (the first padding token's position, where GPT-2's
end-of-text, being the padding token, stands) unless the answer fills the row (then its last token):

    seq           p0  p1  p2 | a0  a1  a2  pad pad          P = 3, L = 8, start = 2
    t (log_probs)  0   1   2   3   4   5   6                 log_probs[:, t] scores seq[t + 1]
    action_mask    .   .   1   1   1   0   0                 ends = 2 + 3 + 1 = 6
    rewards        .   .   k   k   k  k+s  0                 k = -kl_ctl (logp - ref), s = clamp(score, -5, 5);
                                                             from ends on rewards and values are zeroed

GRPO, TRL 1.16's GRPOTrainer (trl/trainer/grpo_trainer.py: _generate_and_score_completions for the advantages,
_compute_loss for the loss and the clip-ratio metrics), token-level importance sampling:

    advantages = group_advantages(rewards, num_generations)                       # [B], B = prompts x generations
    per_token_loss, ratio, kl = grpo_per_token_loss(logps, old_logps, advantages, epsilon, epsilon_high, beta, ref)
    loss = grpo_loss(per_token_loss, completion_mask, "dapo", num_items_in_batch=tokens, micro_batches=dp * m)
    reported = grpo_metrics(ratio, advantages, completion_mask, epsilon, epsilon_high, kl)  # {name: (sum, count)}

The loss is the value a training loop that averages over data-parallel ranks and micro-batches backpropagates
(as finetune_gpt.py's): TRL divides grpo/bnpo/dr_grpo by its gradient-accumulation steps and sums those, which is
the same gradient; TRL's dapo value (its steps_per_generation = gradient-accumulation steps) times those steps.
"""
import torch

# DeepSpeed-Chat's DeepSpeedPPOTrainer.__init__ ("Those value can be changed")
KL_CTL = 0.1
CLIP_REWARD_VALUE = 5.0
CLIPRANGE = 0.2
CLIPRANGE_VALUE = 0.2
GAMMA = 1.0
LAM = 0.95

# TRL 1.16's GRPOConfig
EPSILON = 0.2
ADVANTAGE_EPS = 1e-4                       # (r - mean) / (std + 1e-4)
SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
CLIP_RATIO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


# ---- PPO (DeepSpeed-Chat) ------------------------------------------------------------------------------------

def response_ends(action_mask, start):
    """[b] DeepSpeed-Chat's `ends`: start + the answer tokens that are not padding + 1 (one past the last one)."""
    return start + action_mask[:, start:].sum(1).long() + 1


def compute_rewards(log_probs, ref_log_probs, reward_score, action_mask, start, kl_ctl=KL_CTL,
                    clip_reward_value=CLIP_REWARD_VALUE):
    """[b, L - 1] per-token rewards: -kl_ctl (log_probs - ref_log_probs) everywhere, plus the reward-model score
    [b] clamped to +-clip_reward_value at the last position of [start, ends) (DeepSpeed-Chat's compute_rewards;
    a new tensor, the inputs untouched)."""
    rewards = -kl_ctl * (log_probs - ref_log_probs)
    last = response_ends(action_mask, start).clamp(max=rewards.size(1)) - 1      # the slice's end, cut at L - 1
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, last] += torch.clamp(reward_score, -clip_reward_value, clip_reward_value).to(rewards.dtype)
    return rewards


def zero_after_ends(rewards, values, ends):
    """(rewards, values) with every position from ends[j] on set to 0, as new tensors (DeepSpeed-Chat's train_rlhf
    does it in place, so its critic's old_values are the zeroed ones too)."""
    after = torch.arange(rewards.size(1), device=rewards.device)[None, :] >= ends[:, None]     # [b, L - 1]
    return rewards.masked_fill(after, 0), values.masked_fill(after, 0)


def get_advantages_and_returns(values, rewards, start, gamma=GAMMA, lam=LAM):
    """(advantages, returns), [b, L - 1 - start] each: generalised advantage estimation over the positions from
    start to the end (DeepSpeed-Chat's get_advantages_and_returns, after trlx):

        delta_t = r_t + gamma V_{t+1} - V_t            (V past the last position: 0)
        A_t = delta_t + gamma lam A_{t+1},    returns_t = A_t + V_t;    advantages detached."""
    last_gae = 0.0
    reversed_advantages = []
    length = rewards.size(-1)
    for t in reversed(range(start, length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages.detach(), advantages + values[:, start:]


def masked_whiten(values, mask, shift_mean=True):
    """TRL's masked_whiten (trl/experimental/ppo/ppo_trainer.py; trl/core.py up to 0.24): (values - mean) /
    sqrt(var + 1e-8), mean and Bessel-corrected variance over the mask-1 elements (at least two); shift_mean=False
    adds the mean back."""
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = ((values - mean) ** 2 * mask).sum() / count * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def whiten_advantages(advantages, mask):
    """TRL PPO's optional step after GAE: the advantages whitened over the mask, 0 off it (returns keep the
    unwhitened advantages)."""
    return masked_whiten(advantages, mask).masked_fill(mask == 0, 0)


def actor_loss_fn(logprobs, old_logprobs, advantages, mask, cliprange=CLIPRANGE):
    """The clipped policy loss, mean over the mask (DeepSpeed-Chat's actor_loss_fn): ratio = exp((logprobs -
    old_logprobs) mask), loss = sum(max(-A ratio, -A clamp(ratio, 1 - c, 1 + c)) mask) / sum(mask); 0 (with the
    graph) for a mask without a token, where DeepSpeed-Chat's is 0/0 (the mask is 0/1: the same otherwise)."""
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.sum(torch.max(unclipped, clipped) * mask) / mask.sum().clamp_min(1)   # no answer token: 0


def critic_loss_fn(values, old_values, returns, mask, cliprange_value=CLIPRANGE_VALUE):
    """The clipped value loss (DeepSpeed-Chat's critic_loss_fn): values clipped to old_values +- c, 0.5 sum(max(
    (values - returns)^2, (clipped - returns)^2) mask) / sum(mask); 0 for a mask without a token, as above."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * torch.sum(losses * mask) / mask.sum().clamp_min(1)                      # no answer token: 0


# ---- GRPO (TRL 1.16) -----------------------------------------------------------------------------------------

def _nanstd(values, dim=None):
    """TRL's nanstd: the Bessel-corrected standard deviation of the values that are not NaN (NaN below two)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True).to(values.dtype)   # TRL's: float32 (same at fp32)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards, num_generations, scale_rewards="group"):
    """[B] advantages of B = prompts x num_generations completions (a prompt's generations consecutive):
    (reward - its group's mean) / (std + 1e-4), the std that of the group ("group"), of the whole batch ("batch"),
    or none ("none": the difference only); NaN rewards (unscorable) are left out of the statistics and get 0.
    TRL 1.16 GRPOTrainer._generate_and_score_completions, multi_objective_aggregation "sum_then_normalize"."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}: expected one of {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, num_generations)                                   # [prompts, generations]
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        std = (_nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))
    elif scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    if scale_rewards != "none":
        advantages = advantages / (std + ADVANTAGE_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def grpo_per_token_loss(logps, old_logps, advantages, epsilon=EPSILON, epsilon_high=None, beta=0.0,
                        ref_logps=None):
    """(per-token loss, ratio, per-token KL or None), [B, T] each, TRL 1.16 _compute_loss at token level:

        ratio = exp(logps - old_logps),   loss = -min(ratio A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) A)
        beta != 0:  + beta (exp(ref - logps) - (ref - logps) - 1)         (the k3 estimator of KL(policy || ref))

    advantages [B] (one per completion) or [B, T]; epsilon_high None: epsilon."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    per_token_kl = None
    if beta != 0.0:
        log_ratio = ref_logps - logps
        per_token_kl = torch.exp(log_ratio) - log_ratio - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    return per_token_loss, ratio, per_token_kl


def grpo_loss(per_token_loss, mask, loss_type="dapo", max_completion_length=None, num_items_in_batch=None,
              micro_batches=1):
    """The batch's loss under TRL's reductions of the masked per-token losses [B, T] (TRL 1.16 _compute_loss):

        grpo      each completion's mean over its tokens, mean over the completions
        bnpo      sum / this batch's tokens
        dr_grpo   sum / (B x max_completion_length)
        dapo      sum / (num_items_in_batch / micro_batches): num_items_in_batch the tokens of the whole
                  generation batch (every rank, every micro-batch), micro_batches the pieces it is split into (ranks
                  x micro-batches) and the loop averages over; defaults: this batch is the whole one (= bnpo)."""
    total = (per_token_loss * mask).sum()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type dr_grpo divides by max_completion_length: pass it")
        return total / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        tokens = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return total / (tokens.to(total.dtype).clamp(min=1.0) / micro_batches)
    raise ValueError(f"loss_type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")


def grpo_metrics(ratio, advantages, mask, epsilon=EPSILON, epsilon_high=None, per_token_kl=None):
    """TRL 1.16's clip-ratio metrics (and "kl" when per_token_kl is given) as {name: (sum, count)} over the mask-1
    tokens, to sum over ranks and divide once (TRL's global_masked_mean): low = ratio < 1 - epsilon where A < 0,
    high = ratio > 1 + epsilon_high where A > 0 (the tokens whose gradient the clip removes), region = either."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    count = mask.sum()
    reported = {name: ((flags.float() * mask).sum(), count)
                for name, flags in zip(CLIP_RATIO_METRICS, (low, high, low | high))}
    if per_token_kl is not None:
        reported["kl"] = ((per_token_kl * mask).sum(), count)
    return reported
