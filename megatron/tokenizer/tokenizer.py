"""Tokenizer selection (`build_tokenizer(args)`) and Megatron's GPT-2 BPE tokenizer class.

    tokenizer = GPT2BPETokenizer("data/webtext/vocab.json", "data/webtext/merges.txt")
    ids = tokenizer.tokenize("Hello world")          # list of ints
    tokenizer.detokenize(ids) == "Hello world"
    ids.append(tokenizer.eod)                        # the id of <|endoftext|>
"""
from megatron.cli import UserError

from .gpt2_tokenization import ReferenceBPE, TiktokenBPE, load_vocab_and_merges


class TokenizerError(UserError, ValueError):
    """A tokenizer the flags do not name completely (run_main prints it as one line)."""


BACKENDS = ("auto", "tiktoken", "reference")


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from `vocab.json` + `merges.txt` (GPT-2's own files or ones from tools/train_tokenizer.py).

    backend: "tiktoken" (fast, Rust), "reference" (the original Python algorithm) or "auto" = tiktoken when it is
    installed and accepts the files, else reference. Both give identical ids.
    """

    def __init__(self, vocab_file, merge_file, backend="auto"):
        if backend not in BACKENDS:
            raise ValueError(f"tokenizer backend must be one of {BACKENDS}, got {backend!r}")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.encoder, merges = load_vocab_and_merges(vocab_file, merge_file)
        self.decoder = {i: token for token, i in self.encoder.items()}
        self.eod = self.encoder["<|endoftext|>"]
        self.backend = backend
        if backend in ("auto", "tiktoken"):
            try:
                self._bpe = TiktokenBPE(self.encoder, merges)
                self.backend = "tiktoken"
            except ImportError:
                if backend == "tiktoken":
                    raise ImportError("tokenizer backend 'tiktoken' requested but tiktoken is not installed "
                                      "(pip install tiktoken)") from None
            except ValueError as exc:
                if backend == "tiktoken":
                    raise ValueError(f"{merge_file}: tiktoken cannot reproduce these merges exactly: {exc}") from None
        if self.backend != "tiktoken":
            self._bpe = ReferenceBPE(self.encoder, merges)
            self.backend = "reference"

    @property
    def vocab_size(self):
        return len(self.encoder)

    @property
    def vocab(self):
        return self.encoder

    @property
    def inv_vocab(self):
        return self.decoder

    @property
    def eod_id(self):
        return self.eod

    def tokenize(self, text):
        """Text -> list of ids; `<|endoftext|>` inside the text is encoded as ordinary text."""
        return self._bpe.encode(text)

    def detokenize(self, token_ids):
        return self._bpe.decode(list(token_ids))


def vocab_size_with_padding(vocab_size, make_vocab_size_divisible_by, model_parallel_size):
    """Smallest size >= vocab_size divisible by make_vocab_size_divisible_by * model_parallel_size."""
    multiple = make_vocab_size_divisible_by * model_parallel_size
    return -(-vocab_size // multiple) * multiple


def set_padded_vocab_size(args, vocab_size):
    """The one place args.padded_vocab_size is set (a tokenizer's vocabulary, or --vocab-size with --mock-data):
    the word embedding's rows, split evenly over the model-parallel ranks."""
    args.padded_vocab_size = vocab_size_with_padding(vocab_size, args.make_vocab_size_divisible_by,
                                                     args.model_parallel_size)
    return args.padded_vocab_size


def build_tokenizer(args):
    """Build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size.

    Reads args.tokenizer_type, args.vocab_file, args.merge_file, args.make_vocab_size_divisible_by,
    args.model_parallel_size (and args.rank, default 0, to print only once).
    """
    rank = getattr(args, "rank", 0)
    if rank == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    if args.tokenizer_type != "GPT2BPETokenizer":
        raise TokenizerError(f"tokenizer type {args.tokenizer_type!r} is not implemented "
                             "(available: GPT2BPETokenizer)")
    if args.vocab_file is None or args.merge_file is None:
        missing = " and ".join(flag for flag, value in (("--vocab-file", args.vocab_file),
                                                         ("--merge-file", args.merge_file)) if value is None)
        raise TokenizerError(f"GPT2BPETokenizer needs --vocab-file and --merge-file; {missing} not given (the "
                             "default data's: data/webtext/vocab.json and data/webtext/merges.txt)")
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    set_padded_vocab_size(args, tokenizer.vocab_size)
    if rank == 0:
        print(f" > padded vocab (size: {tokenizer.vocab_size}) with "
              f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens (new size: {args.padded_vocab_size}) "
              f"[backend: {tokenizer.backend}]", flush=True)
    return tokenizer
