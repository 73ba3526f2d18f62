"""Reward-model training (DeepSpeed-Chat step 2): GPT-2 with a scalar head, on tools/preprocess_sft_data.py
--preference's pairs. Every flag of pretrain_gpt.py works but pipeline parallelism (model and data parallelism,
--deepspeed with ZeRO 0-3, activation checkpointing, fp16/bf16, LoRA).

    python tools/preprocess_sft_data.py --preference --input pairs.jsonl --output-prefix data/pairs/pairs \\
        --vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt --seq-length 128
    torchrun --nproc_per_node 2 train_reward_model.py <the checkpoint's model flags> --load checkpoints/sft \\
        --save checkpoints/reward --data-path data/pairs/pairs --vocab-file data/webtext/vocab.json \\
        --merge-file data/webtext/merges.txt --seq-length 128 [--reward-loss divergence] [--deepspeed ...]
    python tools/convert_to_hf.py --load checkpoints/reward --output hf/reward   # GPT2ForSequenceClassification

Start and resume as finetune_gpt.py (--load: an SFT or pretrained LM, whose head starts at its normal(0,
--init-method-std) init, or a reward model; a checkpoint in --save resumes exactly; --no-finetune). The model and
the losses (--reward-loss last-token or divergence): megatron/posttrain/reward_driver.py.
"""
import sys

from megatron.initialize import run_main
from megatron.posttrain import reward_driver
from megatron.posttrain.reward_driver import add_reward_args, starting_point  # noqa: F401 (the flags, the start)
from megatron.posttrain.start import reward_model_provider as model_provider  # noqa: F401 (RLHF's critic too)


def main(args_list=None):
    return reward_driver.main(sys.argv[1:] if args_list is None else args_list)


if __name__ == "__main__":
    run_main(main)  # an error the user can fix (megatron.cli.UserError) is one line, exit status 1
