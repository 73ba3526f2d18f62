"""Reward-model training (DeepSpeed-Chat step 2): GPT-2 with a scalar head, on tools/preprocess_sft_data.py
--preference's pairs; the providers Megatron's training loop needs, as in finetune_gpt.py. Every flag of
pretrain_gpt.py works but pipeline parallelism (model and data parallelism, --deepspeed with ZeRO 0-3, activation
checkpointing, fp16/bf16, LoRA).

    python tools/preprocess_sft_data.py --preference --input pairs.jsonl --output-prefix data/pairs/pairs \\
        --vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt --seq-length 128
    torchrun --nproc_per_node 2 train_reward_model.py <the checkpoint's model flags> --load checkpoints/sft \\
        --save checkpoints/reward --data-path data/pairs/pairs --vocab-file data/webtext/vocab.json \\
        --merge-file data/webtext/merges.txt --seq-length 128 [--reward-loss divergence] [--deepspeed ...]
    python tools/convert_to_hf.py --load checkpoints/reward --output hf/reward   # GPT2ForSequenceClassification

The model (GPT2ModelConfig reward_head): the GPT-2 trunk, then `score` = Linear(hidden, 1) without bias on the final
LayerNorm's output (HF GPT2ForSequenceClassification's head; replicated on the model-parallel ranks, whose hidden
states and loss are identical, so its gradient is too and the gradient norm counts it once). A conversation's
score is the reward at its last token that is not end-of-text (megatron/posttrain/reward.py).

Start and resume as finetune_gpt.py: --load is any checkpoint of ours (an SFT or pretrained LM: the head starts at
its normal(0, --init-method-std) init; or a reward model), loaded with --finetune semantics; a checkpoint already
in --save resumes exactly instead; --no-finetune loads everything from --load.

Loss (--reward-loss): last-token -log sigmoid(score_chosen - score_rejected), or divergence (DeepSpeed-Chat's span
average), mean over the global batch's pairs, logged as 'lm loss' with accuracy (the fraction of pairs scored
chosen > rejected), chosen score and rejected score; validation prints the same over --eval-iters batches.
"""
import dataclasses
import sys

import mpu
import pretrain_gpt
from finetune_gpt import add_no_finetune_flag, PRETRAINING_ONLY, preference_datasets, resume_or_start
from megatron import posttrain, zero
from megatron.data.corpora import DataPathError
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.global_vars import get_args, get_tokenizer
from megatron.initialize import run_main
from megatron.guards.operations import NonFiniteError
from megatron.guards.preflight import PreflightError
from megatron.model import GPT2Model
from megatron.model.gpt2_model import GPT2ModelConfig
from megatron.tokenizer.gpt2_tokenization import TokenizerFileError
from megatron.training import pretrain
from megatron.utils import print_rank_0
from megatron.zero import ConfigError
from megatron.checkpoint.layout import CheckpointError


def add_reward_args(parser):
    group = parser.add_argument_group("reward model")
    group.add_argument("--reward-loss", choices=posttrain.reward.LOSSES, default="last-token",
                       help="last-token: -log sigmoid(chosen - rejected score) (HF/TRL); divergence: DeepSpeed-Chat's "
                            "mean of the per-token loss from the first differing token to the end of the longer answer")
    add_no_finetune_flag(parser, group, "reward")
    return parser


def model_provider():
    """GPT2Model with the reward head (zero.Init at ZeRO-3), the rest of its config from the arguments."""
    args = get_args()
    pretrain_gpt.set_deepspeed_activation_checkpointing(args)
    print_rank_0("building GPT2 reward model ...")
    config = dataclasses.replace(GPT2ModelConfig.from_args(args), reward_head=True)
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(), remote_device=args.remote_device,
                   enabled=args.zero_stage == 3):
        return GPT2Model(config)


def forward_step(data_iterator, model):
    return posttrain.reward.reward_forward_step(get_args().reward_loss, get_tokenizer().eod, data_iterator, model)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    return preference_datasets(train_val_test_num_samples)


def starting_point(args_list):
    """The command line to train with: a checkpoint in --save wins over --load (an exact resume); bad flags exit
    with one line (status 2) before anything starts."""
    from megatron.arguments import build_parser
    parser = build_parser(add_reward_args)
    args = parser.parse_args(args_list)
    given = [flag for dest, flag in PRETRAINING_ONLY.items() if getattr(args, dest)]
    if given:
        parser.error(f"{given[0]} is a pretraining flag; train_reward_model.py reads --data-path PREFIX (the "
                     "--output-prefix of tools/preprocess_sft_data.py --preference)")
    if not args.data_path or len(args.data_path) != 1:
        parser.error(f"--data-path takes one PREFIX (the --output-prefix of tools/preprocess_sft_data.py "
                     f"--preference), got {args.data_path}")
    if args.pipeline_model_parallel_size > 1:
        parser.error("a reward model scores whole conversations on one pipeline stage: drop "
                     "--pipeline-model-parallel-size (a pipelined checkpoint loads at 1)")
    if args.vocab_file is None or args.merge_file is None:
        parser.error("reward training needs the tokenizer the data was made with: --vocab-file and --merge-file")
    return resume_or_start(parser, args, args_list, "reward-model", "a reward model",
                           "finetune_gpt.py's or pretrain_gpt.py's --save, or tools/convert_from_hf.py's")


def main(args_list=None):
    args_list = starting_point(sys.argv[1:] if args_list is None else args_list)
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                    extra_args_provider=add_reward_args, args_list=args_list)


if __name__ == "__main__":
    run_main(main, (CheckpointError, ConfigError, NonFiniteError, PreflightError, DataPathError, IndexedDatasetError,
                    TokenizerFileError, posttrain.SFTDataError))  # one line naming the problem
