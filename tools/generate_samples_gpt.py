"""Sample from a trained GPT-2 checkpoint (Megatron's tools/generate_samples_gpt2.py flags), at any
model-parallel size, from a checkpoint of either path (Megatron or --deepspeed), loaded weights-only.

    torchrun --nproc_per_node 2 tools/generate_samples_gpt.py --model-parallel-size 2 <model flags> \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --load CKPT \\
        --sample-input-file prompts.txt --sample-output-file samples.txt --out-seq-length 64 --top_p 0.9
    ... --num-samples 8 --genfile unconditional.jsonl         # unconditional samples (start from <|endoftext|>)
    ... (no --sample-input-file, no --num-samples)            # interactive: a prompt per line, empty line quits

The model flags (--num-layers, --hidden-size, --num-attention-heads, --max-position-embeddings, ...) must match
the checkpoint. With --mock-data --vocab-size N instead of a tokenizer, prompts and outputs are token ids
separated by spaces (and there is no end-of-document id: samples run to --out-seq-length).
--out-seq-length is the number of new tokens per sample (capped by the position table). --recompute re-runs the
whole sequence at every step instead of using the KV cache. Prompts are decoded in batches of --batch-size.
--chat-template NAME (a finetune_gpt.py model): each prompt becomes a user turn of that template, ending with its
assistant prefix (deepspeed-chat: " Human: {prompt} Assistant:"); a sample ends at the end-of-text token.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.global_vars import get_tokenizer  # noqa: E402
from megatron.initialize import initialize_megatron, run_main  # noqa: E402
from megatron.posttrain import TEMPLATES, encode_prompt  # noqa: E402
from megatron.text_generation import InferenceInputError, generate, load_inference_model  # noqa: E402
from megatron.text_generation.generation import check_sampling_options  # noqa: E402


def add_text_generate_args(parser):
    group = parser.add_argument_group("text generation")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    group.add_argument("--greedy", action="store_true", help="argmax decoding")
    group.add_argument("--top_p", type=float, default=0.0, help="nucleus sampling (0: off)")
    group.add_argument("--top_k", type=int, default=0, help="top-k sampling (0: off)")
    group.add_argument("--out-seq-length", type=int, default=1024, help="new tokens per sample")
    group.add_argument("--sample-input-file", type=str, default=None, help="one prompt per line")
    group.add_argument("--sample-output-file", type=str, default=None,
                       help="where conditional samples go (default: <input file>.out)")
    group.add_argument("--num-samples", type=int, default=0, help="unconditional samples to draw")
    group.add_argument("--genfile", type=str, default=None, help="JSON-lines output of unconditional samples")
    group.add_argument("--recompute", action="store_true", help="no KV cache: recompute the whole sequence")
    group.add_argument("--chat-template", choices=sorted(TEMPLATES), default=None,
                       help="wrap each prompt as a user turn of this template, ending with its assistant prefix "
                            "(deepspeed-chat: ' Human: {prompt} Assistant:'), for a model from finetune_gpt.py; "
                            "the answer ends at the end-of-text token")
    # Generation reads no training data: satisfy the training parser's data check.
    parser.set_defaults(data_path=["(text generation: no data)"])
    return parser


class Codec:
    """Text <-> ids through the tokenizer, or space-separated ids with --mock-data. With a chat template a prompt
    is encoded as the user turn the fine-tuning data had (megatron.posttrain.encode_prompt)."""

    def __init__(self, tokenizer, chat_template=None):
        self.tokenizer = tokenizer
        self.eod = tokenizer.eod if tokenizer is not None else None
        self.template = TEMPLATES[chat_template] if chat_template else None

    def encode(self, text):
        if self.tokenizer is None:
            return [int(t) for t in text.split()]
        if self.template is not None:
            return encode_prompt([{"role": "user", "content": text}], self.tokenizer, self.template)
        return self.tokenizer.tokenize(text)

    def decode(self, ids):
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.detokenize([t for t in ids if t != self.eod])


def _share(obj):
    """rank 0's obj on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _generate(model, args, codec, prompts):
    return generate(model, prompts, args.out_seq_length, greedy=args.greedy, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, eod_id=codec.eod, use_cache=not args.recompute,
                    seed=args.seed)


def _batches(items, size):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def read_prompts(path):
    """The non-empty lines of `path` (rank 0 reads, every rank gets them); InferenceInputError when it is missing."""
    lines = None
    if dist.get_rank() == 0 and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()]
    lines = _share(lines)
    if lines is None:
        raise InferenceInputError(f"--sample-input-file {path} does not exist")
    return lines


def check_prompt_lengths(prompts, path, max_positions):
    """Before any sample is drawn: a prompt that does not fit the position table names its line."""
    for number, prompt in enumerate(prompts, 1):
        if len(prompt) > max_positions:
            raise InferenceInputError(f"{path}:{number}: the prompt has {len(prompt)} tokens, longer than the "
                                      f"position table (--max-position-embeddings {max_positions}): shorten it")


def generate_samples_input_from_file(model, args, codec):
    lines = read_prompts(args.sample_input_file)
    prompts = [codec.encode(line) for line in lines]
    check_prompt_lengths(prompts, args.sample_input_file, args.max_position_embeddings)
    output_path = args.sample_output_file or args.sample_input_file + ".out"
    outputs = []
    for batch in _batches(list(zip(lines, prompts)), args.batch_size):
        for (line, _), new in zip(batch, _generate(model, args, codec, [prompt for _, prompt in batch])):
            outputs.append((line, codec.decode(new)))
    if dist.get_rank() == 0:
        with open(output_path, "w", encoding="utf-8") as handle:
            for context, text in outputs:
                handle.write(f"Context: {context}\n\nMegatron-LM: {text}\n\n")
        print(f"wrote {len(outputs)} samples to {output_path}", flush=True)


def generate_unconditional_samples(model, args, codec):
    start = [codec.eod if codec.eod is not None else 0]
    records = []
    for batch in _batches(list(range(args.num_samples)), args.batch_size):
        for new in _generate(model, args, codec, [start] * len(batch)):
            finished = codec.eod is not None and bool(new) and new[-1] == codec.eod
            records.append({"text": codec.decode(new), "length": len(new), "finished": finished})
    if dist.get_rank() == 0:
        path = args.genfile or "unconditional_samples.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        print(f"wrote {len(records)} unconditional samples to {path}", flush=True)


def generate_samples_interactive(model, args, codec):
    while True:
        text = None
        if dist.get_rank() == 0:
            try:
                text = input("Context prompt (empty line to quit) >>> ")
            except EOFError:
                text = ""
        text = _share(text)
        if not text.strip():
            return
        new = _generate(model, args, codec, [codec.encode(text)])[0]
        if dist.get_rank() == 0:
            print(f"\nMegatron-LM: {codec.decode(new)}\n", flush=True)


def main(args_list=None):
    args = initialize_megatron(extra_args_provider=add_text_generate_args, args_list=args_list)
    check_sampling_options(args.out_seq_length, args.greedy, args.temperature, args.top_k, args.top_p)
    model = load_inference_model(args, "generation with --chat-template" if args.chat_template else "generation",
                                 need_tokenizer=bool(args.chat_template))
    codec = Codec(get_tokenizer(), args.chat_template)
    if args.sample_input_file:
        generate_samples_input_from_file(model, args, codec)
    elif args.num_samples > 0:
        generate_unconditional_samples(model, args, codec)
    else:
        generate_samples_interactive(model, args, codec)


if __name__ == "__main__":
    run_main(main)
