"""The reward model of DeepSpeed-Chat's step 2 (train_reward_model.py): GPT-2 with a scalar head (GPT2ModelConfig
reward_head: `score`, Linear(h, 1) without bias, as HF GPT2ForSequenceClassification), trained on preference pairs
(tools/preprocess_sft_data.py --preference; sft_dataset.PreferenceDataset) to score the chosen answer higher.

    rewards = model(tokens, position_ids, None)                     # [2b, s]: one per token, rows c0 r0 c1 r1 ...
    losses, chosen, rejected = pair_losses(rewards, tokens, pad_id, "last-token")     # [b] each

A conversation's score is its reward at the last token that is not padding (pad = end-of-text, which also ends
every answer: the answer's last token; HF GPT2ForSequenceClassification's rule with config.pad_token_id = eod):

    tokens   " Human: Hi"  " Assistant:"  " Hello"  "!"  <|endoftext|>  <|endoftext|> ...
    score                                           ^ here

Losses, per pair (mean over the global batch's pairs):
    last-token   -log sigmoid(score_chosen - score_rejected)                                  (HF/TRL)
    divergence   DeepSpeed-Chat's: the mean of -log sigmoid(r_chosen[t] - r_rejected[t]) over the tokens t from
                 the first one where the two rows differ to the end of the longer conversation (its end: one past
                 the scored token; DeepSpeed-Chat's c_ind, the first padding token, the same for single-turn
                 pairs); a pair of identical rows: the scored token only
Metrics: accuracy = the fraction of pairs with score_chosen > score_rejected, chosen/rejected score = their means.
"""
import torch
import torch.nn.functional as F

import mpu
from megatron.checkpoint.rng import preserved_rng_state

from .common import pair_batch, sum_over_group

LOSSES = ("last-token", "divergence")
METRICS = ("accuracy", "chosen score", "rejected score")


def end_indices(tokens, pad_id):
    """[rows] each row's last position whose token is not pad_id (0 for a row of padding only)."""
    positions = torch.arange(tokens.size(1), device=tokens.device)               # [s]
    return (positions * tokens.ne(pad_id)).argmax(dim=-1)


def divergence_span(tokens, ends):
    """[pairs, s] bool: DeepSpeed-Chat's span of each pair (rows 2i, 2i + 1) from the first differing token to the
    end of the longer conversation; identical rows: their scored token."""
    chosen, rejected = tokens[0::2], tokens[1::2]                                 # [n, s]
    differ = chosen.ne(rejected)
    positions = torch.arange(tokens.size(1), device=tokens.device)
    end = torch.maximum(ends[0::2], ends[1::2]) + 1                               # [n], exclusive
    first = torch.where(differ.any(-1), (differ * 1).argmax(-1), ends[0::2])
    end = torch.maximum(end, first + 1)
    return (positions >= first[:, None]) & (positions < end[:, None])


def pair_losses(rewards, tokens, pad_id, loss):
    """(per-pair losses [n], chosen scores [n], rejected scores [n] (detached)) from per-token rewards [2n, s] of
    the rows c0 r0 c1 r1 ... and their tokens."""
    rewards = rewards.float()
    ends = end_indices(tokens, pad_id)
    scores = rewards.gather(1, ends[:, None])[:, 0].view(-1, 2)                   # [n, 2]
    chosen, rejected = scores[:, 0], scores[:, 1]
    if loss == "last-token":
        losses = -F.logsigmoid(chosen - rejected)
    elif loss == "divergence":
        span = divergence_span(tokens, ends).float()                              # [n, s]
        per_token = -F.logsigmoid(rewards[0::2] - rewards[1::2])                  # [n, s]
        losses = (per_token * span).sum(-1) / span.sum(-1)
    else:
        raise ValueError(f"reward loss {loss!r}: expected one of {', '.join(LOSSES)}")
    return losses, chosen.detach(), rejected.detach()


def reward_forward_step(loss, pad_id, data_iterator, model):
    """train_reward_model.py's forward step: (the micro-batch's mean pair loss, for the backward; {"lm loss": the
    reward loss, accuracy, chosen score, rejected score} as (sum, count) pairs summed over the data-parallel
    group). Every micro-batch holds the same number of pairs, so the loop's averaging gives the global pair mean."""
    tokens, _, _, attention_mask, position_ids = pair_batch(data_iterator)       # [2b, s]
    rewards = model(tokens, position_ids, attention_mask)                         # [2b, s]
    losses, chosen, rejected = pair_losses(rewards, tokens, pad_id, loss)
    sums = [losses.detach().sum(), (chosen > rejected).float().sum(), chosen.sum(), rejected.sum(),
            losses.numel()]                                             # tensors: read on the host once a step
    totals = sum_over_group(sums, "reward metrics", mpu.get_data_parallel_group())
    count = totals[-1]
    reported = {"lm loss": (totals[0], count)}
    reported.update({name: (value, count) for name, value in zip(METRICS, totals[1:4])})
    return losses.mean(), reported


@preserved_rng_state()
def load_reward_model(load_dir, padded_vocab_size, device):
    """A reward model checkpoint (train_reward_model.py's --save, any topology) as a GPT2Model with its scalar head,
    whole on this model-parallel rank (not partitioned, eval mode, no gradients): what finetune_gpt.py
    --reward-model scores its samples with. CheckpointError (one line) for a checkpoint without the head. Built
    mid-training: every RNG is left as it was (the model's initialisation draws from the default generator before
    the checkpoint's weights overwrite it; without that the training's next dropout masks would move)."""
    from megatron.checkpoint import layout as ckpt, reshard
    from megatron.checkpoint.full_checkpoint import FullCheckpoint
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    from megatron.model.hf_interchange import REWARD_HEAD
    saved = reshard.SavedCheckpoint(load_dir)
    shape = FullCheckpoint(saved).require_gpt2("--reward-model")
    if REWARD_HEAD not in saved.weights_of[0]:
        raise ckpt.CheckpointError(f"--reward-model {load_dir} has no reward head ({REWARD_HEAD}): pass a "
                                   "train_reward_model.py checkpoint")
    config = GPT2ModelConfig(num_layers=shape["num_layers"], vocab_size=padded_vocab_size,
                             hidden_size=shape["hidden_size"], num_attention_heads=shape["num_attention_heads"],
                             max_sequence_length=shape["max_sequence_length"], real_vocab_size=shape["vocab_size"],
                             layernorm_epsilon=shape["layernorm_epsilon"], reward_head=True)
    model = GPT2Model(config).to(device)
    world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            rows = mpu.full_shape(param)[0] * world if reshard.partitioning(name)[2] else None
            param.copy_(saved.shard(name, "weight", world, rank, rows))
            param.requires_grad_(False)
    return model.eval()


@preserved_rng_state()
def score_sequences(model, sequences, pad_id):
    """[len(sequences)] floats: each token list's reward at its last token that is not pad_id (as training scores
    a conversation), the rows right-padded with pad_id into one batch."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence, device=device)
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        rewards = model(tokens, positions, None).float()                         # [b, s]
    return rewards.gather(1, end_indices(tokens, pad_id).unsqueeze(1))[:, 0].tolist()
