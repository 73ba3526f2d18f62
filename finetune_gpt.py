"""Supervised fine-tuning of GPT-2 (DeepSpeed-Chat step 1): the providers Megatron's training loop needs, as in
pretrain_gpt.py, on tools/preprocess_sft_data.py's output. Every flag of pretrain_gpt.py works (model, tensor and
pipeline parallelism, data parallelism, --deepspeed with ZeRO 0-3, activation checkpointing, fp16/bf16).

    python tools/preprocess_sft_data.py --input chat.jsonl --output-prefix data/chat/chat \\
        --vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt --seq-length 128
    torchrun --nproc_per_node 2 finetune_gpt.py <the checkpoint's model flags> --load checkpoints/gpt2 \\
        --save checkpoints/sft --data-path data/chat/chat --vocab-file data/webtext/vocab.json \\
        --merge-file data/webtext/merges.txt --seq-length 128 [--pack-sequences] [--train-on-prompt] [--deepspeed ...]

Start and resume: --load is any checkpoint of ours (either path, any topology) or a tools/convert_from_hf.py
import, loaded with --finetune semantics (the weights only: a fresh optimizer, lr schedule, iteration and
sampler). When --save already holds a checkpoint, the run resumes from it instead, exactly as pretraining resumes
(optimizer, schedule, RNG, and the sampler from the consumed samples): rerunning the same command line after an
interruption continues the run. --no-finetune loads everything from --load (a resume from another directory).

Loss: only where the mask is 1 (the answers and their end-of-text; --train-on-prompt: every token but padding,
DeepSpeed-Chat's step-1 behaviour), sum over the whole global batch / its number of such tokens (exact across
data-parallel ranks and micro-batches: megatron/posttrain/sft_loss.py). Rows are one example each, padded with
end-of-text (mask 0) to the longest in the micro-batch (--pad-to-seq-length, or pipeline parallelism: to
--seq-length), or with --pack-sequences several examples up to --seq-length + 1 tokens, attention and positions
reset at every example boundary. Validation prints the token-weighted loss (total loss / total answer tokens over
all --eval-iters batches and data-parallel ranks) and its perplexity.

DPO (DeepSpeed-Chat's step 3 replaced by Direct Preference Optimization): --objective dpo --dpo-beta B on
tools/preprocess_sft_data.py --preference's pairs, from an SFT checkpoint (--load). 'lm loss' is the sigmoid DPO
loss (mean over the global batch's pairs), logged (and in --log-jsonl) with TRL's rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies. The reference policy is the starting weights, frozen, computed in the same
step: with --lora-rank the model with its adapters off (no copy), else a frozen copy taken before the first update
(megatron/posttrain/dpo.py; no packing, no pipeline parallelism, ZeRO-3 only with LoRA).
"""
import functools
import os
import sys

import mpu
import pretrain_gpt
from megatron import posttrain
from megatron.data.corpora import DataPathError
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.global_vars import get_args, get_timers, get_tokenizer
from megatron.initialize import run_main
from megatron.guards.operations import NonFiniteError
from megatron.guards.preflight import PreflightError
from megatron.tokenizer.gpt2_tokenization import TokenizerFileError
from megatron.training import pretrain
from megatron.utils import print_rank_0
from megatron.zero import ConfigError
from megatron.checkpoint.layout import TRACKER_FILENAME, CheckpointError

# Pretraining's data flags: fine-tuning data come from --data-path, its example boundaries from the rows.
PRETRAINING_ONLY = {"mock_data": "--mock-data", "train_data": "--train-data",
                    "reset_attention_mask": "--reset-attention-mask", "reset_position_ids": "--reset-position-ids",
                    "eod_mask_loss": "--eod-mask-loss"}


def add_no_finetune_flag(parser, group, run):
    """--no-finetune (Megatron's --finetune inverted: by default --load gives the weights only, and a checkpoint in
    --save resumes exactly instead), for this script and train_reward_model.py."""
    group.add_argument("--no-finetune", dest="finetune", action="store_false",
                       help=f"load the optimizer, lr schedule, counters and RNG from --load too (resume a {run} "
                            "run from a directory other than --save)")
    parser.set_defaults(finetune=True)


def add_finetune_args(parser):
    group = parser.add_argument_group("fine-tuning")
    group.add_argument("--pack-sequences", action="store_true",
                       help="pack several examples into each row of --seq-length + 1 tokens (next-fit, in order); "
                            "attention and position ids restart at every example")
    group.add_argument("--train-on-prompt", action="store_true",
                       help="loss on every token but padding (DeepSpeed-Chat's step 1), not only on the answers")
    group.add_argument("--pad-to-seq-length", action="store_true",
                       help="pad every row to --seq-length (default: to the longest in the micro-batch; pipeline "
                            "parallelism always pads to --seq-length)")
    add_no_finetune_flag(parser, group, "fine-tuning")
    group.add_argument("--objective", choices=("sft", "dpo"), default="sft",
                       help="sft: the masked LM loss on --data-path's examples; dpo: Direct Preference Optimization "
                            "on tools/preprocess_sft_data.py --preference's pairs (megatron/posttrain/dpo.py), the "
                            "reference policy being the starting weights (with --lora-rank: the base model)")
    group.add_argument("--dpo-reference", default=None,
                       help="the reference policy's checkpoint for --objective dpo without LoRA (default: the "
                            "starting weights; a resume reads the --load it started from)")
    group.add_argument("--dpo-beta", type=float, default=0.1,
                       help="DPO's beta: the sigmoid loss -log sigmoid(beta * (chosen - rejected log-ratio)); > 0")
    group.add_argument("--sample-every", type=int, default=0,
                       help="every N iterations of this run, print the greedy continuations of --sample-prompts by "
                            "the model being trained (0: off)")
    group.add_argument("--sample-prompts", default=None, help="a text file: one prompt per non-empty line")
    group.add_argument("--sample-length", type=int, default=32, help="new tokens per --sample-every continuation")
    group.add_argument("--reward-model", default=None,
                       help="score every --sample-every continuation (prompt + generation) with this reward model "
                            "(train_reward_model.py's --save, any topology): printed beside it, and with "
                            "--log-jsonl a 'sample' record each")
    return parser


def read_sample_prompts(path):
    """The non-empty lines of --sample-prompts."""
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


class TrainingSamples:
    """--sample-every N: before the first micro-batch of every N-th iteration's successor (after N, 2N, ...
    iterations of this run), the greedy continuations of --sample-prompts by the model being trained, printed by
    rank 0 (generate_from_training_model on the ZeRO engine at any stage or the Megatron path's model: modes and
    RNG restored, so the training is the one without samples). Every rank generates (ZeRO-3 gathers)."""

    def __init__(self, step):
        self.step, self.training_micro_batches = step, 0
        self.reward_model = None       # --reward-model, loaded at the first samples

    def __call__(self, data_iterator, model):
        args = get_args()
        if args.sample_every > 0 and model.training:     # validation forwards are not counted
            done, per_sample = self.training_micro_batches, args.num_micro_batches * args.sample_every
            if done and done % per_sample == 0:
                if args.reward_model is not None and self.reward_model is None:
                    from megatron.posttrain.reward import load_reward_model
                    self.reward_model = load_reward_model(args.reward_model, args.padded_vocab_size,
                                                          mpu.get_device())
                print_samples(model, done // args.num_micro_batches, args, self.reward_model)
            self.training_micro_batches += 1
        return self.step(data_iterator, model)


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


model_provider = pretrain_gpt.model_provider   # the same GPT2Model (zero.Init at ZeRO-3) as pretraining


def get_batch(step_batches, data_iterator):
    """(tokens, labels, loss_mask, attention_mask, position_ids, mask tokens of the whole step)."""
    args = get_args()
    trim = not (args.pack_sequences or args.pad_to_seq_length or args.pipeline_model_parallel_size > 1)
    rows, step_tokens = step_batches.next(data_iterator, args.num_micro_batches, mpu.get_data_parallel_group(), trim)
    return posttrain.model_inputs(rows, args.pack_sequences) + (step_tokens,)


def forward_step(step_batches, data_iterator, model):
    """The backward sees this micro-batch's masked loss sum x (dp x micro-batches) / the step's mask tokens (the
    loop's averaging then gives the global batch's token mean); 'lm loss' is reported as a (sum, count) pair summed
    over the data-parallel group."""
    args, timers = get_args(), get_timers()
    timers("batch generator").start()
    tokens, labels, loss_mask, attention_mask, position_ids, step_tokens = get_batch(step_batches, data_iterator)
    timers("batch generator").stop()
    losses = model(tokens, position_ids, attention_mask, labels=labels)   # [b, s]
    if not mpu.is_pipeline_last_stage():
        return losses, {}
    loss_sum, count = posttrain.masked_sum(losses, loss_mask)
    scale = args.data_parallel_size * args.num_micro_batches / step_tokens.clamp_min(1.0)
    total, tokens_seen = posttrain.sum_over_group([loss_sum.detach(), count], "sft lm loss",
                                                  mpu.get_data_parallel_group())
    return loss_sum * scale.to(loss_sum.dtype), {"lm loss": (total, tokens_seen)}   # read on the host once a step


def objective_step(step_batches, reference, data_iterator, model):
    """The forward step of --objective: sft (forward_step) or dpo (megatron/posttrain/dpo.py: 'lm loss' is the DPO
    loss, logged with TRL's rewards/*)."""
    args = get_args()
    if args.objective == "sft":
        return forward_step(step_batches, data_iterator, model)
    reference.resuming = not args.finetune   # a resume's first forward no longer sees the starting weights
    reference.checkpoint = args.dpo_reference
    return posttrain.dpo.dpo_forward_step(reference, args.dpo_beta, data_iterator, model)


def preference_datasets(train_val_test_num_samples):
    """The train/validation/test preference datasets of --data-path (DPO here, and the reward model's)."""
    args = get_args()
    print_rank_0("> building train, validation, and test preference datasets ...")
    datasets = posttrain.build_preference_datasets(args.data_path[0], args.split, train_val_test_num_samples,
                                                   args.seq_length, args.seed, get_tokenizer().eod,
                                                   args.global_batch_size)
    for dataset in datasets:
        if dataset is not None:
            print_rank_0(f"    {dataset.describe()}")
    return datasets


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    if args.objective == "dpo":
        return preference_datasets(train_val_test_num_samples)
    print_rank_0("> building train, validation, and test SFT datasets ...")
    datasets = posttrain.build_sft_datasets(args.data_path[0], args.split, train_val_test_num_samples,
                                            args.seq_length, args.seed, get_tokenizer().eod, args.pack_sequences,
                                            args.train_on_prompt, args.global_batch_size)
    for dataset in datasets:
        if dataset is not None:
            print_rank_0(f"    {dataset.describe()}")
    return datasets


def starting_point(args_list):
    """The command line to train with: a checkpoint in --save wins over --load (an exact resume); bad fine-tuning
    flags exit with one line (status 2) before anything starts."""
    from megatron.arguments import build_parser
    parser = build_parser(add_finetune_args)
    args = parser.parse_args(args_list)
    given = [flag for dest, flag in PRETRAINING_ONLY.items() if getattr(args, dest)]
    if given:
        parser.error(f"{given[0]} is a pretraining flag; finetune_gpt.py reads --data-path PREFIX (the "
                     "--output-prefix of tools/preprocess_sft_data.py) and resets attention per example with "
                     "--pack-sequences")
    if not args.data_path or len(args.data_path) != 1:
        parser.error(f"--data-path takes one PREFIX (the --output-prefix of tools/preprocess_sft_data.py), got "
                     f"{args.data_path}")
    if args.objective == "dpo":
        refused = [flag for flag, given in (("--pack-sequences", args.pack_sequences),
                                            ("--train-on-prompt", args.train_on_prompt),
                                            ("--pipeline-model-parallel-size > 1",
                                             args.pipeline_model_parallel_size > 1)) if given]
        if refused:
            parser.error(f"--objective dpo scores whole chosen/rejected answers on one pipeline stage: drop "
                         f"{refused[0]}")
        if not args.dpo_beta > 0:
            parser.error(f"--dpo-beta ({args.dpo_beta}) must be > 0")
    sampling_error = _sampling_flags_error(args)
    if sampling_error:
        parser.error(sampling_error)
    if args.vocab_file is None or args.merge_file is None:
        parser.error("fine-tuning needs the tokenizer the data was made with: --vocab-file and --merge-file")
    return resume_or_start(parser, args, args_list, "fine-tuning", "fine-tuning",
                           "pretrain_gpt.py's --save, or tools/convert_from_hf.py's")


def resume_or_start(parser, args, args_list, run, subject, sources):
    """A checkpoint in --save wins over --load (the `run` run resumes exactly: counters, optimizer, RNG); otherwise
    it starts from --load's weights (finetune semantics), which must hold a checkpoint: else "`subject` starts from
    a checkpoint" and `sources` (whose --save to pass), exit status 2."""
    if args.save is not None and os.path.isfile(os.path.join(args.save, TRACKER_FILENAME)):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"> resuming the {run} run in --save {args.save} (its checkpoint wins over --load "
                  f"{args.load})", flush=True)
        resumed = list(args_list) + ["--load", args.save, "--no-finetune"]
        if getattr(args, "objective", None) == "dpo" and args.dpo_reference is None and args.load is not None:
            resumed += ["--dpo-reference", args.load]     # the reference: the weights the run started from
        return resumed
    if args.load is None or not os.path.isfile(os.path.join(args.load, TRACKER_FILENAME)):
        where = "" if args.load is None else f": {args.load} holds no {TRACKER_FILENAME}"
        parser.error(f"{subject} starts from a checkpoint: pass --load DIR ({sources}){where}")
    return list(args_list)


def _sampling_flags_error(args):
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


def main(args_list=None):
    args_list = starting_point(sys.argv[1:] if args_list is None else args_list)
    # this run's micro-batch buffer (sft) and reference policy (dpo)
    step = TrainingSamples(functools.partial(objective_step, posttrain.StepBatches(), posttrain.dpo.Reference()))
    return pretrain(train_valid_test_datasets_provider, model_provider, step, extra_args_provider=add_finetune_args,
                    args_list=args_list)


if __name__ == "__main__":
    run_main(main, (CheckpointError, ConfigError, NonFiniteError, PreflightError, DataPathError, IndexedDatasetError,
                    TokenizerFileError, posttrain.SFTDataError, posttrain.dpo.DPOReferenceError))  # one line naming the problem
