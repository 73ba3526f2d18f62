"""The driver of finetune_gpt.py: supervised fine-tuning of GPT-2 (DeepSpeed-Chat step 1) and DPO, composed of
pretraining's loop (megatron.training.pretrain) and the post-training pieces. Every flag of pretrain_gpt.py works
(model, tensor and pipeline parallelism, data parallelism, --deepspeed with ZeRO 0-3, activation checkpointing,
fp16/bf16).

    history = main(["--load", "checkpoints/gpt2", "--save", "checkpoints/sft", "--data-path", "data/chat/chat", ...])

Start and resume: megatron/posttrain/start.py (--load gives the weights, a checkpoint in --save resumes exactly).

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
(megatron/posttrain/common.py's Reference; the loss: megatron/posttrain/dpo.py; no packing, no pipeline parallelism,
ZeRO-3 only with LoRA).
"""
import functools

import mpu
from megatron.global_vars import get_args, get_timers, get_tokenizer
from megatron.training import pretrain
from megatron.utils import print_rank_0

from . import dpo
from .common import Reference, model_inputs, sum_over_group
from .samples import TrainingSamples, sampling_flags_error
from .sft_dataset import build_sft_datasets
from .sft_loss import StepBatches, masked_sum
from .start import (add_no_finetune_flag, check_data_flags, language_model_provider, preference_datasets,
                    require_tokenizer, resume_or_start)


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
                       help="every N iterations of this run and after its last, print the greedy continuations of "
                            "--sample-prompts by the model being trained (0: off)")
    group.add_argument("--sample-prompts", default=None, help="a text file: one prompt per non-empty line")
    group.add_argument("--sample-length", type=int, default=32, help="new tokens per --sample-every continuation")
    group.add_argument("--reward-model", default=None,
                       help="score every --sample-every continuation (prompt + generation) with this reward model "
                            "(train_reward_model.py's --save, any topology): printed beside it, and with "
                            "--log-jsonl a 'sample' record each")
    return parser


def get_batch(step_batches, data_iterator):
    """(tokens, labels, loss_mask, attention_mask, position_ids, mask tokens of the whole step)."""
    args = get_args()
    trim = not (args.pack_sequences or args.pad_to_seq_length or args.pipeline_model_parallel_size > 1)
    rows, step_tokens = step_batches.next(data_iterator, args.num_micro_batches, mpu.get_data_parallel_group(), trim)
    return model_inputs(rows, args.pack_sequences) + (step_tokens,)


def forward_step(step_batches, data_iterator, model):
    """The backward sees this micro-batch's masked loss sum x (dp x micro-batches) / the step's mask tokens (the
    loop's averaging then gives the global batch's token mean); 'lm loss' is reported as a (sum, count) pair summed
    over the data-parallel group."""
    args, timers = get_args(), get_timers()
    timers("batch-generator").start()
    tokens, labels, loss_mask, attention_mask, position_ids, step_tokens = get_batch(step_batches, data_iterator)
    timers("batch-generator").stop()
    losses = model(tokens, position_ids, attention_mask, labels=labels)   # [b, s]
    if not mpu.is_pipeline_last_stage():
        return losses, {}
    loss_sum, count = masked_sum(losses, loss_mask)
    scale = args.data_parallel_size * args.num_micro_batches / step_tokens.clamp_min(1.0)
    total, tokens_seen = sum_over_group([loss_sum.detach(), count], "sft lm loss", mpu.get_data_parallel_group())
    return loss_sum * scale.to(loss_sum.dtype), {"lm loss": (total, tokens_seen)}   # read on the host once a step


def objective_step(step_batches, reference, data_iterator, model):
    """The forward step of --objective: sft (forward_step) or dpo (megatron/posttrain/dpo.py: 'lm loss' is the DPO
    loss, logged with TRL's rewards/*)."""
    args = get_args()
    if args.objective == "sft":
        return forward_step(step_batches, data_iterator, model)
    reference.resuming = not args.finetune   # a resume's first forward no longer sees the starting weights
    reference.checkpoint = args.dpo_reference
    return dpo.dpo_forward_step(reference, args.dpo_beta, data_iterator, model)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    if args.objective == "dpo":
        return preference_datasets(train_val_test_num_samples)
    print_rank_0("> building train, validation, and test SFT datasets ...")
    datasets = build_sft_datasets(args.data_path[0], args.split, train_val_test_num_samples, args.seq_length,
                                  args.seed, get_tokenizer().eod, args.pack_sequences, args.train_on_prompt,
                                  args.global_batch_size)
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
    check_data_flags(parser, args, reads="finetune_gpt.py reads --data-path PREFIX (the --output-prefix of "
                     "tools/preprocess_sft_data.py) and resets attention per example with --pack-sequences",
                     source="the --output-prefix of tools/preprocess_sft_data.py")
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
    sampling_error = sampling_flags_error(args)
    if sampling_error:
        parser.error(sampling_error)
    require_tokenizer(parser, args, "fine-tuning")
    return resume_or_start(parser, args, args_list, "fine-tuning", "fine-tuning",
                           "pretrain_gpt.py's --save, or tools/convert_from_hf.py's")


def main(args_list):
    """Fine-tune from the command line `args_list`; returns the training history (megatron.training.pretrain)."""
    args_list = starting_point(args_list)
    # this run's micro-batch buffer (sft) and reference policy (dpo)
    step = TrainingSamples(functools.partial(objective_step, StepBatches(), Reference()))
    return pretrain(train_valid_test_datasets_provider, language_model_provider, step,
                    extra_args_provider=add_finetune_args, args_list=args_list, after_training=step.after_training)
