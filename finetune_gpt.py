"""Supervised fine-tuning of GPT-2 (DeepSpeed-Chat step 1) on tools/preprocess_sft_data.py's output, or DPO on its
--preference pairs (--objective dpo). Every flag of pretrain_gpt.py works (model, tensor and pipeline parallelism,
data parallelism, --deepspeed with ZeRO 0-3, activation checkpointing, fp16/bf16).

    python tools/preprocess_sft_data.py --input chat.jsonl --output-prefix data/chat/chat \\
        --vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt --seq-length 128
    torchrun --nproc_per_node 2 finetune_gpt.py <the checkpoint's model flags> --load checkpoints/gpt2 \\
        --save checkpoints/sft --data-path data/chat/chat --vocab-file data/webtext/vocab.json \\
        --merge-file data/webtext/merges.txt --seq-length 128 [--pack-sequences] [--train-on-prompt] [--deepspeed ...]

--load is any checkpoint of ours (either path, any topology) or a tools/convert_from_hf.py import, loaded with
--finetune semantics (the weights only); when --save already holds a checkpoint the run resumes from it exactly
(rerunning the same command line after an interruption continues the run); --no-finetune loads everything from
--load. The loss, packing, validation and DPO: megatron/posttrain/sft_driver.py.
"""
import sys

from megatron.initialize import run_main
from megatron.posttrain import sft_driver
from megatron.posttrain.sft_driver import add_finetune_args, starting_point  # noqa: F401 (the flags, the start)


def main(args_list=None):
    return sft_driver.main(sys.argv[1:] if args_list is None else args_list)


if __name__ == "__main__":
    run_main(main)  # an error the user can fix (megatron.cli.UserError) is one line, exit status 1
