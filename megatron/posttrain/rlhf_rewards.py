"""Verifiable rewards for train_rlhf.py --reward-fn module:function (TRL's convention: called with keyword lists
prompts, completions (texts; a completion without its end-of-text) and completion_ids; one float per completion).

    python train_rlhf.py --algorithm grpo --reward-fn megatron.posttrain.rlhf_rewards:answer_length ...

Toys a tiny model can learn in minutes (make rlhf), and the shape of a user's own function.
"""
LENGTH_CAP = 12


def answer_length(completions, **kwargs):
    """The answer's number of words, up to LENGTH_CAP, divided by it: 0 for an empty answer, 1 from 12 words."""
    return [min(len(text.split()), LENGTH_CAP) / LENGTH_CAP for text in completions]


def says_yes(completions, **kwargs):
    """1 when the answer contains the word "yes" (any case), else 0."""
    return [float("yes" in text.lower().split()) for text in completions]
