"""Zero-shot evaluation of a pretrain_gpt.py checkpoint (Megatron's tasks/main.py for GPT-2), at any
model-parallel size, loaded weights-only (either checkpoint path: Megatron or --deepspeed).

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --overlapping-eval 32 \\
        <model flags> --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --load CKPT [--batch-size 8]
    torchrun --nproc_per_node 2 tasks/main.py --model-parallel-size 2 --task LAMBADA --valid-data lambada.jsonl \\
        [--strict-lambada] ...

Windows/examples are --seq-length tokens; --overlapping-eval is the stride of the WikiText windows (the new tokens
each scores; default 32, at most --seq-length). Semantics of every metric: tasks/zeroshot_gpt.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.global_vars import get_tokenizer  # noqa: E402
from megatron.initialize import initialize_megatron, run_main  # noqa: E402
from megatron.text_generation import InferenceInputError, load_inference_model  # noqa: E402
from tasks import zeroshot_gpt  # noqa: E402
from tasks.zeroshot_gpt import TaskError  # noqa: E402  (bad input: one line, exit status 1)

TASKS = ("WIKITEXT103", "LAMBADA")


def add_tasks_args(parser):
    group = parser.add_argument_group("tasks")
    group.add_argument("--task", required=True, choices=TASKS, help="zero-shot task")
    group.add_argument("--valid-data", nargs="*", default=None, help="the evaluation file (the first is used)")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="WikiText window stride: new tokens scored per window (<= --seq-length)")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA: every token of the last word, tokenized alone, must be predicted")
    parser.set_defaults(data_path=["(zero-shot evaluation: no training data)"])
    return parser


def _check_inputs(args):
    if args.task == "WIKITEXT103" and not 1 <= args.overlapping_eval <= args.seq_length:
        raise TaskError(f"--overlapping-eval is {args.overlapping_eval}: give the window stride, from 1 to "
                        f"--seq-length ({args.seq_length})")
    if not args.valid_data:
        raise TaskError("--valid-data FILE is required")
    if not os.path.isfile(args.valid_data[0]):
        raise TaskError(f"--valid-data {args.valid_data[0]} does not exist")


def main(args_list=None):
    """Returns the result dict (printed on rank 0)."""
    args = initialize_megatron(extra_args_provider=add_tasks_args, args_list=args_list)
    _check_inputs(args)
    try:
        model = load_inference_model(args, "zero-shot evaluation", need_tokenizer=True)
    except InferenceInputError as error:
        raise TaskError(str(error)) from None
    tokenizer = get_tokenizer()
    path = args.valid_data[0]
    if args.task == "WIKITEXT103":
        with open(path, "rb") as handle:
            raw = handle.read().decode("utf-8")
        result = zeroshot_gpt.evaluate_wikitext(model, tokenizer, raw, args.seq_length, args.overlapping_eval,
                                                args.batch_size, args.real_vocab_size)
    else:
        result = zeroshot_gpt.evaluate_lambada(model, tokenizer, zeroshot_gpt.read_lambada(path), args.seq_length,
                                               args.strict_lambada, args.batch_size, args.real_vocab_size)
    if dist.get_rank() == 0:
        print(zeroshot_gpt.format_result(args.task, result), flush=True)
    return result


if __name__ == "__main__":
    run_main(main)
