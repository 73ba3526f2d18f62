"""The driver of train_reward_model.py: reward-model training (DeepSpeed-Chat step 2), composed of pretraining's
loop (megatron.training.pretrain), the reward head and its losses (megatron/posttrain/reward.py) and the
preference data (megatron/posttrain/sft_dataset.py).

    history = main(["--load", "checkpoints/sft", "--save", "checkpoints/reward", "--data-path", "data/pairs", ...])

The model (GPT2ModelConfig reward_head): the GPT-2 trunk, then `score` = Linear(hidden, 1) without bias on the final
LayerNorm's output (HF GPT2ForSequenceClassification's head; replicated on the model-parallel ranks, whose hidden
states and loss are identical, so its gradient is too and the gradient norm counts it once). A conversation's
score is the reward at its last token that is not end-of-text (megatron/posttrain/reward.py).

Start and resume (megatron/posttrain/start.py): --load is any checkpoint of ours (an SFT or pretrained LM: the head
starts at its normal(0, --init-method-std) init; or a reward model), loaded with --finetune semantics; a checkpoint
already in --save resumes exactly instead; --no-finetune loads everything from --load.

Loss (--reward-loss): last-token -log sigmoid(score_chosen - score_rejected), or divergence (DeepSpeed-Chat's span
average), mean over the global batch's pairs, logged as 'lm loss' with accuracy (the fraction of pairs scored
chosen > rejected), chosen score and rejected score; validation prints the same over --eval-iters batches.
"""
from megatron.global_vars import get_args, get_tokenizer
from megatron.training import pretrain

from . import reward
from .start import (add_no_finetune_flag, check_data_flags, preference_datasets, require_tokenizer,
                    resume_or_start, reward_model_provider)


def add_reward_args(parser):
    group = parser.add_argument_group("reward model")
    group.add_argument("--reward-loss", choices=reward.LOSSES, default="last-token",
                       help="last-token: -log sigmoid(chosen - rejected score) (HF/TRL); divergence: DeepSpeed-Chat's "
                            "mean of the per-token loss from the first differing token to the end of the longer answer")
    add_no_finetune_flag(parser, group, "reward")
    return parser


def forward_step(data_iterator, model):
    return reward.reward_forward_step(get_args().reward_loss, get_tokenizer().eod, data_iterator, model)


def starting_point(args_list):
    """The command line to train with: a checkpoint in --save wins over --load (an exact resume); bad flags exit
    with one line (status 2) before anything starts."""
    from megatron.arguments import build_parser
    parser = build_parser(add_reward_args)
    args = parser.parse_args(args_list)
    check_data_flags(parser, args, reads="train_reward_model.py reads --data-path PREFIX (the --output-prefix of "
                     "tools/preprocess_sft_data.py --preference)",
                     source="the --output-prefix of tools/preprocess_sft_data.py --preference")
    if args.pipeline_model_parallel_size > 1:
        parser.error("a reward model scores whole conversations on one pipeline stage: drop "
                     "--pipeline-model-parallel-size (a pipelined checkpoint loads at 1)")
    require_tokenizer(parser, args, "reward training")
    if args.eval_tasks:
        parser.error("--eval-tasks scores a language model's next tokens; a reward model outputs a score: drop it")
    return resume_or_start(parser, args, args_list, "reward-model", "a reward model",
                           "finetune_gpt.py's or pretrain_gpt.py's --save, or tools/convert_from_hf.py's")


def main(args_list):
    """Train a reward model from the command line `args_list`; returns the training history."""
    args_list = starting_point(args_list)
    return pretrain(preference_datasets, reward_model_provider, forward_step, extra_args_provider=add_reward_args,
                    args_list=args_list)
