"""Verifiable rewards for train_rlhf.py --reward-fn module:function (TRL's convention: called with keyword lists
prompts, completions (texts; a completion without its end-of-text) and completion_ids; one float per completion).

    python train_rlhf.py --algorithm grpo --reward-fn megatron.posttrain.rlhf_rewards:answer_length ...

Toys a tiny model can learn in minutes (make rlhf), and the shape of a user's own function.
"""
TARGET_WORDS = 6


def answer_length(completions, **kwargs):
    """How close the answer is to TARGET_WORDS words: 1 - |words - 6| / 6, at least 0 (1 at six words, 0 for an
    empty answer or one of 12 words or more): a model that answers too briefly learns to say more, one that never
    stops learns to end its answer (both move mostly one logit, end-of-text's)."""
    return [max(0.0, 1.0 - abs(len(text.split()) - TARGET_WORDS) / TARGET_WORDS) for text in completions]


def says_yes(completions, **kwargs):
    """1 when the answer contains the word "yes" (any case), else 0."""
    return [float("yes" in text.lower().split()) for text in completions]
