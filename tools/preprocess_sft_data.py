"""Tokenize prompt/response or multi-turn chat JSONL for finetune_gpt.py: token ids and a loss mask, as two aligned
Megatron indexed datasets (one document per example).

    python tools/preprocess_sft_data.py --input chat.jsonl --output-prefix data/chat/chat \\
        --vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt \\
        [--chat-template deepspeed-chat] [--workers 2] [--seq-length 128 --on-long truncate] [--on-error skip]
    -> data/chat/chat_input_ids_document.{bin,idx}   token ids (uint16 for vocabularies under 65,500)
       data/chat/chat_loss_mask_document.{bin,idx}   1 on the answers' tokens and their end-of-text, else 0 (uint8)
    finetune_gpt.py ... --data-path data/chat/chat

Each line is {"prompt": ..., "response": ...} or {"messages": [{"role": "system"|"user"|"assistant", "content":
...}, ...]} (the last message an assistant's; loss on every assistant turn). The chat template (megatron/posttrain/
sft_data.py; default deepspeed-chat, DeepSpeed-Chat's " Human: {prompt} Assistant: {response}<|endoftext|>")
lays the turns out. A bad line is named as FILE:LINE: and stops the run (--on-error refuse, the default) or is
skipped and counted (--on-error skip). --seq-length S: an example of more than S + 1 tokens (S predictions, the
model's --seq-length) is cut to its first S + 1 tokens (--on-long truncate, the default; an example left without
any answer token is dropped and counted) or stops the run (--on-long refuse). The input is streamed in blocks of
whole lines through --workers processes, written in input order (the same bytes for any --workers), under
temporary names renamed when complete.

--preference: each line is {"prompt": ..., "chosen": ..., "rejected": ...} (three strings: the user turn and two
answers), written as PREFIX_pairs_input_ids_document and PREFIX_pairs_loss_mask_document. Each pair is two
consecutive documents, 2i the chosen conversation and 2i + 1 the rejected one, each laid out and masked exactly as
the SFT example {"prompt", "response": chosen/rejected} (mask 1 on the answer and its end-of-text); the pair is
refused, skipped or dropped as a whole (--on-long truncate cuts each to S + 1 tokens and drops the pair when
either is left without an answer token). finetune_gpt.py --objective dpo and train_reward_model.py read them.
"""
import collections
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
from megatron import cli  # noqa: E402
from megatron.data.indexed_dataset import (MMapIndexedDatasetBuilder, best_fitting_dtype,  # noqa: E402
                                           building_datasets, data_file_path, index_file_path)
from megatron.posttrain import sft_data  # noqa: E402
from megatron.posttrain.sft_dataset import INPUT_IDS, LOSS_MASK, output_prefixes  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.gpt2_tokenization import TokenizerFileError  # noqa: E402
from preprocess_data import encoded_blocks  # noqa: E402

MAX_NAMED_SKIPS = 20   # skipped lines named on stderr; the rest only counted


class BadLine(cli.UserError, ValueError):
    """A line refused (--on-error refuse, --on-long refuse); the message starts with FILE:LINE:."""


class Encoder:
    """Per-process state: the tokenizer and the options, built once per worker."""

    def __init__(self, options):
        self.options = options
        self.tokenizer = GPT2BPETokenizer(options.vocab_file, options.merge_file)
        self.template = sft_data.TEMPLATES[options.chat_template]
        self.dtype = best_fitting_dtype(self.tokenizer.vocab_size)
        self.max_tokens = None if options.seq_length is None else options.seq_length + 1

    def encode_block(self, first_line, block):
        """Whole lines -> (ids, mask, lengths arrays, counts, messages about skipped lines)."""
        ids, mask, lengths = [], [], []
        counts = collections.Counter()
        skipped = []
        for line_number, line in enumerate(block.split(b"\n"), first_line):
            if not line.strip():
                continue
            where = f"{self.options.input}:{line_number}"
            try:
                documents = self._encode_line(line, where, counts)
            except sft_data.ExampleError as error:
                if self.options.on_error == "refuse":
                    raise BadLine(f"{where}: {error} (--on-error skip skips such lines)") from None
                counts["bad"] += 1
                skipped.append(f"{where}: {error}")
                continue
            if documents is None:
                continue
            for example_ids, example_mask in documents:
                ids.extend(example_ids)
                mask.extend(example_mask)
                lengths.append(len(example_ids))
                counts["answer_tokens"] += sum(example_mask)
            counts["examples"] += 1
        return (np.array(ids, dtype=self.dtype), np.array(mask, dtype=np.uint8), np.array(lengths, dtype=np.int32),
                counts, skipped)

    def _encode_line(self, line, where, counts):
        """[(ids, mask)] of one line ([chosen, rejected] with --preference), or None for an example (a pair: either
        conversation) dropped after truncation."""
        try:
            record = json.loads(line)
        except ValueError as error:   # JSONDecodeError and UnicodeDecodeError
            raise sft_data.ExampleError(f"malformed JSON ({error})") from None
        conversations = (sft_data.parse_preference(record) if self.options.preference
                         else [sft_data.parse_example(record)])
        documents = [sft_data.encode_example(messages, self.tokenizer, self.template) for messages in conversations]
        longest = max(len(ids) for ids, _ in documents)
        if self.max_tokens is None or longest <= self.max_tokens:
            return documents
        if self.options.on_long == "refuse":
            raise BadLine(f"{where}: the example has {longest} tokens, more than --seq-length "
                          f"{self.options.seq_length} + 1: raise --seq-length, or pass --on-long truncate to keep "
                          "its start")
        counts["truncated"] += 1
        documents = [sft_data.truncate_example(ids, mask, self.max_tokens) for ids, mask in documents]
        if not all(any(mask) for _, mask in documents):
            counts["dropped"] += 1
            return None
        return documents


def preprocess(options, clock=time.monotonic):
    """The whole conversion; returns a stats dict (with the summary line). Raises BadLine naming FILE:LINE."""
    prefixes = output_prefixes(options.output_prefix, options.preference)
    os.makedirs(os.path.dirname(os.path.abspath(options.output_prefix)), exist_ok=True)
    vocab_size = GPT2BPETokenizer(options.vocab_file, options.merge_file).vocab_size
    counts = collections.Counter()
    named = 0
    progress = cli.ProgressLine("Processed", "examples", clock=clock)
    total_bytes = max(os.path.getsize(options.input), 1)
    dtypes = {INPUT_IDS: best_fitting_dtype(vocab_size), LOSS_MASK: np.uint8}

    def new_builder(key, path):
        return MMapIndexedDatasetBuilder(path, dtype=dtypes[key])

    with building_datasets(prefixes, new_builder) as builders:
        for (ids, mask, lengths, block_counts, skipped), consumed in encoded_blocks(options, Encoder):
            per_document = np.ones(len(lengths), dtype=np.int64)
            builders[INPUT_IDS].add_documents(ids, lengths, per_document)
            builders[LOSS_MASK].add_documents(mask, lengths, per_document)
            counts.update(block_counts)
            counts["tokens"] += ids.size
            for message in skipped:
                if named < MAX_NAMED_SKIPS:
                    print(f"skipped {message}", file=sys.stderr)
                named += 1
            progress.update(counts["examples"], consumed, consumed / total_bytes)
        if counts["examples"] == 0:
            raise BadLine(f"{options.input}: no usable example ({counts['bad']} bad lines, {counts['dropped']} "
                          "dropped): nothing written")
    notes = []
    if counts["bad"]:
        notes.append(f"skipped {counts['bad']} bad lines")
    if counts["truncated"]:
        notes.append(f"cut {counts['truncated']} examples to --seq-length {options.seq_length} + 1 tokens")
    if counts["dropped"]:
        notes.append(f"dropped {counts['dropped']} of them left without an answer token")
    summary = progress.summary(counts=f", {counts['tokens']} tokens ({counts['answer_tokens']} with loss)",
                               details=f", template {options.chat_template}, {options.workers} workers",
                               trailer="".join(f"; {note}" for note in notes))
    return {"summary": summary, "outputs": prefixes,
            **{key: counts[key] for key in ("examples", "tokens", "answer_tokens", "bad", "truncated", "dropped")}}


def get_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSONL: prompt/response or messages per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_input_ids_document and "
                        "PREFIX_loss_mask_document (finetune_gpt.py --data-path PREFIX)")
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--preference", action="store_true",
                        help='preference pairs: each line {"prompt", "chosen", "rejected"} -> '
                             "PREFIX_pairs_{input_ids,loss_mask}_document, the pair's chosen and rejected "
                             "conversations as two consecutive documents (finetune_gpt.py --objective dpo, "
                             "train_reward_model.py)")
    parser.add_argument("--chat-template", choices=sorted(sft_data.TEMPLATES), default=sft_data.DEFAULT_TEMPLATE,
                        help="how turns are laid out (megatron/posttrain/sft_data.py)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="longest example: S + 1 tokens (the model's --seq-length S); default: no limit")
    parser.add_argument("--on-long", choices=["truncate", "refuse"], default="truncate",
                        help="an example longer than --seq-length + 1 tokens: keep its start, or stop")
    parser.add_argument("--on-error", choices=["skip", "refuse"], default="refuse",
                        help="a bad line: skip it (named on stderr and counted), or stop naming it")
    options = parser.parse_args(argv)
    cli.require_range(parser, options, positive=("workers", "seq_length"))
    for flag, path in (("--input", options.input), ("--vocab-file", options.vocab_file),
                       ("--merge-file", options.merge_file)):
        if not os.path.isfile(path):
            parser.error(f"{flag} {path}: file not found")
    return options


def main(argv=None, clock=time.monotonic):
    options = get_args(argv)
    try:
        stats = preprocess(options, clock)
    except (BadLine, TokenizerFileError, ValueError, OSError) as error:
        raise SystemExit(f"error: {error}")
    print(stats["summary"], file=sys.stderr)
    for prefix in stats["outputs"].values():
        print(f"wrote {data_file_path(prefix)} and {index_file_path(prefix)}", file=sys.stderr)
    return stats


if __name__ == "__main__":
    main()
