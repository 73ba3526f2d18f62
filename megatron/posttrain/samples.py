"""finetune_gpt.py's --sample-every: greedy continuations of --sample-prompts by the model being trained, printed
every N iterations and after the last (and scored by --reward-model if given), without changing the training.

    step = TrainingSamples(forward_step)          # a forward step that prints the samples when they are due
    pretrain(..., step, after_training=step.after_training)   # and after the last iteration
    error = sampling_flags_error(args)            # None, or the one-line complaint about the sampling flags
"""
import os

import mpu
from megatron.global_vars import get_args, get_tokenizer
from megatron.utils import print_rank_0


def read_sample_prompts(path):
    """The non-empty lines of --sample-prompts."""
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


class TrainingSamples:
    """--sample-every N: before the first micro-batch of every N-th iteration's successor (after N, 2N, ...
    iterations of this run) and once the loop ends (after_training: after its last iteration), the greedy
    continuations of --sample-prompts by the model being trained, printed by rank 0 (generate_from_training_model
    on the ZeRO engine at any stage or the Megatron path's model: modes and RNG restored, so the training is the one
    without samples). Every rank generates (ZeRO-3 gathers)."""

    def __init__(self, step):
        self.step, self.training_micro_batches = step, 0
        self.reward_model = None       # --reward-model, loaded at the first samples

    def __call__(self, data_iterator, model):
        args = get_args()
        if args.sample_every > 0 and model.training:     # validation forwards are not counted
            done, per_sample = self.training_micro_batches, args.num_micro_batches * args.sample_every
            if done and done % per_sample == 0:
                self._print(model, done // args.num_micro_batches, args)
            self.training_micro_batches += 1
        return self.step(data_iterator, model)

    def after_training(self, model):
        """The samples after the run's last iteration (no later forward prints them); none when it trained none.
        Never a repeat: the last samples printed came before at least one more training micro-batch."""
        args = get_args()
        if args.sample_every > 0 and self.training_micro_batches:
            self._print(model, self.training_micro_batches // args.num_micro_batches, args)

    def _print(self, model, iterations, args):
        if args.reward_model is not None and self.reward_model is None:
            from megatron.posttrain.reward import load_reward_model
            self.reward_model = load_reward_model(args.reward_model, args.padded_vocab_size, mpu.get_device())
        print_samples(model, iterations, args, self.reward_model)


def print_samples(model, iterations, args, reward_model=None):
    from megatron.text_generation import generate_from_training_model
    tokenizer = get_tokenizer()
    texts = read_sample_prompts(args.sample_prompts)
    keep = args.max_position_embeddings - 1                       # room for at least one new token
    prompts = [tokenizer.tokenize(text)[-keep:] or [tokenizer.eod] for text in texts]
    new = generate_from_training_model(model, prompts, args.sample_length, greedy=True, eod_id=tokenizer.eod)
    rewards = [None] * len(new)
    if reward_model is not None:
        from megatron.posttrain.reward import score_sequences
        rewards = score_sequences(reward_model, [p + n for p, n in zip(prompts, new)], tokenizer.eod)
    for text, prompt, tokens, reward in zip(texts, prompts, new, rewards):
        scored = "" if reward is None else f" (reward {reward:.4f})"
        print_rank_0(f"[sample] after {iterations} iterations: {text!r} -> {tokenizer.detokenize(tokens)!r}{scored}")
        if reward is not None and args.log_jsonl and args.rank == 0:
            from megatron.guards import operations
            operations.write_jsonl_record(args.log_jsonl, {
                "type": "sample", "iteration": iterations, "prompt": text, "text": tokenizer.detokenize(tokens),
                "tokens": list(prompt) + list(tokens), "reward": reward})


def sampling_flags_error(args):
    """What is wrong with --sample-every/--sample-prompts/--sample-length (None when nothing)."""
    if args.sample_every < 0 or args.sample_length < 1:
        return f"--sample-every ({args.sample_every}) must be >= 0 and --sample-length ({args.sample_length}) >= 1"
    if not args.sample_every:
        return "--reward-model scores --sample-every's samples: add --sample-every N" if args.reward_model else None
    if args.sample_prompts is None:
        return "--sample-every needs --sample-prompts FILE (one prompt per line)"
    if not os.path.isfile(args.sample_prompts):
        return f"--sample-prompts {args.sample_prompts}: no such file"
    if args.reward_model is not None and not os.path.isdir(args.reward_model):
        return f"--reward-model {args.reward_model}: no such directory"
    if not read_sample_prompts(args.sample_prompts):
        return f"--sample-prompts {args.sample_prompts} holds no prompt (one per non-empty line)"
    if args.pipeline_model_parallel_size > 1:
        return "--sample-every needs the whole model on one stage: drop it or use --pipeline-model-parallel-size 1"
    return None
