"""The command-line conventions every entry point shares (pretrain_gpt.py, the tools, tasks/main.py): a bad flag is
one line on stderr naming it and what to do, and a non-zero exit, never a usage block or a traceback.

    parser = ArgumentParser(description=...)          # argparse's, with a one-line error() (exit status 2)
    require_range(parser, args, positive=("num_layers", "seq_length"), non_negative=("train_iters",))

Imports only the standard library, so light tools (tokenizer training, preprocessing) can use it too.
"""
import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose error() prints `prog: error: message (see --help)` as one line, exit 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {' '.join(str(message).split())} (see --help)\n")
        sys.exit(2)


def flag(dest):
    """The command-line spelling of an argparse destination: 'seq_length' -> '--seq-length'."""
    return "--" + dest.replace("_", "-")


def require_range(parser, args, positive=(), non_negative=()):
    """parser.error naming the first flag given a value outside its range (None means unset: not checked)."""
    for names, bad, wanted in ((positive, lambda v: v <= 0, "a positive number"),
                               (non_negative, lambda v: v < 0, "zero or a positive number")):
        for dest in names:
            value = getattr(args, dest, None)
            if value is not None and bad(value):
                parser.error(f"{flag(dest)} is {value}: it must be {wanted}")
