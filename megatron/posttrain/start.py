"""What every post-training driver (sft_driver, reward_driver, rlhf_driver) shares before and at its start: the
checks of the command line, start-or-resume, the models and the preference data.

    parser = build_parser(add_driver_args)            # megatron.arguments' parser plus the driver's group
    args = parser.parse_args(args_list)
    check_data_flags(parser, args, reads="finetune_gpt.py reads --data-path PREFIX ...", source="...")
    args_list = resume_or_start(parser, args, args_list, "fine-tuning", "fine-tuning", "pretrain_gpt.py's --save")

Start and resume: --load is any checkpoint of ours, loaded with --finetune semantics (the weights only: a fresh
optimizer, lr schedule, iteration and sampler). When --save already holds a checkpoint, the run resumes from it
instead, exactly as pretraining resumes: rerunning the same command line after an interruption continues the run.
--no-finetune loads everything from --load (a resume from another directory).
"""
import os

from megatron.checkpoint.layout import TRACKER_FILENAME
from megatron.global_vars import get_args, get_tokenizer
from megatron.model.providers import gpt_model
from megatron.utils import print_rank_0

from .sft_dataset import build_preference_datasets

# Pretraining's data flags: post-training data come from --data-path, its example boundaries from the rows.
PRETRAINING_ONLY = {"mock_data": "--mock-data", "train_data": "--train-data",
                    "reset_attention_mask": "--reset-attention-mask", "reset_position_ids": "--reset-position-ids",
                    "eod_mask_loss": "--eod-mask-loss"}


def add_no_finetune_flag(parser, group, run):
    """--no-finetune (Megatron's --finetune inverted: by default --load gives the weights only, and a checkpoint in
    --save resumes exactly instead), for every post-training driver."""
    group.add_argument("--no-finetune", dest="finetune", action="store_false",
                       help=f"load the optimizer, lr schedule, counters and RNG from --load too (resume a {run} "
                            "run from a directory other than --save)")
    parser.set_defaults(finetune=True)


def check_data_flags(parser, args, reads, source):
    """parser.error (one line, exit status 2) for a pretraining data flag (`reads`: what the script reads instead)
    or a --data-path that is not one PREFIX (`source`: where the PREFIX comes from)."""
    given = [flag for dest, flag in PRETRAINING_ONLY.items() if getattr(args, dest)]
    if given:
        parser.error(f"{given[0]} is a pretraining flag; {reads}")
    if not args.data_path or len(args.data_path) != 1:
        parser.error(f"--data-path takes one PREFIX ({source}), got {args.data_path}")


def require_tokenizer(parser, args, run):
    if args.vocab_file is None or args.merge_file is None:
        parser.error(f"{run} needs the tokenizer the data was made with: --vocab-file and --merge-file")


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


def language_model_provider():
    """The same GPT2Model (zero.Init at ZeRO-3) as pretraining: the SFT/DPO model and RLHF's actor."""
    return gpt_model(get_args())


def reward_model_provider():
    """GPT2Model with the reward head (zero.Init at ZeRO-3): the reward model and RLHF's critic."""
    return gpt_model(get_args(), reward_head=True)


def preference_datasets(train_val_test_num_samples):
    """The train/validation/test preference datasets of --data-path (DPO, and the reward model's)."""
    args = get_args()
    print_rank_0("> building train, validation, and test preference datasets ...")
    datasets = build_preference_datasets(args.data_path[0], args.split, train_val_test_num_samples,
                                         args.seq_length, args.seed, get_tokenizer().eod, args.global_batch_size)
    for dataset in datasets:
        if dataset is not None:
            print_rank_0(f"    {dataset.describe()}")
    return datasets
