"""Train a GPT-2-style byte-level BPE on loose JSON and write `vocab.json` + `merges.txt` in GPT-2's format.

    python tools/train_tokenizer.py --input data/webtext/webtext.json --output-dir data/webtext --vocab-size 8192

Uses Hugging Face `tokenizers` (byte-level pre-tokenizer with GPT-2's split pattern, the 256 byte tokens as the
initial alphabet, `<|endoftext|>` as a special token, which gets id 0). The files load unchanged in
megatron.tokenizer.GPT2BPETokenizer (both backends), in HF tokenizers and in transformers' GPT2Tokenizer.
If the trainer emits a merge whose result already exists (possible in HF's trainer), the later duplicate is
dropped: it can never fire in GPT-2's algorithm, and without it tiktoken reproduces the merges exactly.
Use this for a non-English corpus or the embedded default; with GPT-2's own files, skip it.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron import cli  # noqa: E402
from megatron.checkpoint.atomic_io import atomic_write_text  # noqa: E402

EOD_TOKEN = "<|endoftext|>"


def iter_texts(paths, json_key):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)[json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise SystemExit(f"{path}:{line_number}: not a JSON object with key {json_key!r} ({exc})")


def train(paths, output_dir, vocab_size=8192, min_frequency=2, json_key="text"):
    """Train and write output_dir/{vocab.json,merges.txt}; returns their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(iter_texts(paths, json_key), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab, merges = model["vocab"], model["merges"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in merges]
    kept, made = [], set()
    for left, right in merges:
        if left + right not in made:
            made.add(left + right)
            kept.append((left, right))
    os.makedirs(output_dir, exist_ok=True)
    vocab_path, merges_path = os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt")
    for path, content in ((vocab_path, json.dumps(vocab, ensure_ascii=False)),
                          (merges_path, "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in kept))):
        atomic_write_text(path, content)
    return vocab_path, merges_path, len(merges) - len(kept)


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, nargs="+", help="loose JSON file(s)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--json-key", default="text")
    args = parser.parse_args(argv)
    cli.require_range(parser, args, positive=("vocab_size", "min_frequency"))
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input {path}: file not found")
    start = time.time()
    vocab_path, merges_path, dropped = train(args.input, args.output_dir, args.vocab_size, args.min_frequency,
                                             args.json_key)
    print(f"wrote {vocab_path} and {merges_path} in {time.time() - start:.1f} s"
          + (f" ({dropped} duplicate merges dropped)" if dropped else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
