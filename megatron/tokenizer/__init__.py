"""Tokenizers: `build_tokenizer(args)` for training scripts, `GPT2BPETokenizer` for everything else."""
from .gpt2_tokenization import TokenizerFileError
from .tokenizer import GPT2BPETokenizer, build_tokenizer, vocab_size_with_padding

__all__ = ["GPT2BPETokenizer", "TokenizerFileError", "build_tokenizer", "vocab_size_with_padding"]
