"""The command-line conventions every entry point shares (pretrain_gpt.py, the tools, tasks/main.py): a bad flag is
one line on stderr naming it and what to do, and a non-zero exit, never a usage block or a traceback.

    parser = ArgumentParser(description=...)          # argparse's, with a one-line error() (exit status 2)
    require_range(parser, args, positive=("num_layers", "seq_length"), non_negative=("train_iters",))
    progress = ProgressLine("Converted", "tensors", total=148)   # at most one progress line a second, a summary
    class ConfigError(UserError, ValueError): ...     # bad input a user can fix: run_main prints it as one line

Imports only the standard library, so light tools (tokenizer training, preprocessing) can use it too.
"""
import argparse
import difflib
import sys
import time


class UserError(Exception):
    """The one base of every error a user can fix (bad flags, files, checkpoints, configs, data; a run that
    diverged): as Click's UsageError, megatron.initialize.run_main catches this class alone and prints
    `error: <message>` as one line, exit status 1, no traceback. Each subclass keeps its own name, its message
    (one line naming the problem and the fix) and its older builtin base (ValueError, RuntimeError, ...), so
    `except ValueError` still catches it. An error that signals a bug in our code does not derive from it
    (tests/test_layout.py walks every error class of the project and holds the list of those)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose error() prints `prog: error: message (see --help)` as one line, exit 2, and
    whose parse_args suggests the nearest flag for a misspelt one (as zero.config does for a JSON key):
    `unrecognized arguments: --context-paralel-size 2; did you mean --context-parallel-size?`."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {' '.join(str(message).split())} (see --help)\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{nearest_flags_hint(self, unknown)}")
        return parsed


def nearest_flags_hint(parser, unknown):
    """'; did you mean --x?' naming the parser's nearest flag to each unknown one in `unknown` (an argument list:
    values and `--flag=value` allowed), or '' when none is close (difflib, as zero.config's key hints)."""
    flags = sorted(option for action in parser._actions for option in action.option_strings)
    words = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    close = {word: difflib.get_close_matches(word, flags, n=1) for word in words}
    hints = [match[0] if len(words) == 1 else f"{match[0]} (for {word})" for word, match in close.items() if match]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def one_line_errors(parser, prog):
    """Give a third-party argparse parser (and its subcommands' parsers) this module's one-line error(), under the
    name the user ran it by (`prog`): e.g. lm-eval's command line run as `python -m ...lm_eval_model`."""
    old_prog = parser.prog
    parser.prog, parser.error = prog, ArgumentParser.error.__get__(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                one_line_errors(sub, sub.prog.replace(old_prog, prog, 1))


def flag(dest):
    """The command-line spelling of an argparse destination: 'seq_length' -> '--seq-length'."""
    return "--" + dest.replace("_", "-")


# What each range accepts and how a message names it; written as "accepted" tests so that NaN is out of every range.
RANGES = {"positive": (lambda v: v > 0, "a positive number"),
          "non_negative": (lambda v: v >= 0, "zero or a positive number"),
          "fraction": (lambda v: 0 <= v < 1, "a number in [0, 1)")}


def out_of_range(value, kind):
    """What `value` must be (RANGES[kind]'s words) when it is outside that range; None when it is inside."""
    accepted, wanted = RANGES[kind]
    return None if accepted(value) else wanted


def require_range(parser, args, positive=(), non_negative=(), fraction=()):
    """parser.error naming the first flag given a value outside its range (None means unset: not checked)."""
    for kind, names in (("positive", positive), ("non_negative", non_negative), ("fraction", fraction)):
        for dest in names:
            value = getattr(args, dest, None)
            wanted = None if value is None else out_of_range(value, kind)
            if wanted:
                parser.error(f"{flag(dest)} is {value}: it must be {wanted}")


class ProgressLine:
    """A progress line on stderr at most once per `interval` seconds while a long loop runs, then a summary (the
    one rate-limited printer of preprocess_data.py, checkpoint_util.py, convert_to_hf.py and convert_from_hf.py):

        progress = ProgressLine("Converted", "tensors", total=148)
        for name in names:
            ...
            progress.advance(1, nbytes=tensor.nbytes)
        #  Converted 37/148 tensors (25%), 36 tensors/s, 12.30 MB/s        (at most one such line a second)
        progress.finish()
        #  Done: 148 tensors, 50.2 MB in 4.1 s (36 tensors/s, 12.24 MB/s)

    A line is printed when at least `interval` seconds passed since the start or the previous line, so a loop
    that ends within a second prints only the summary. `clock` (default time.monotonic) is injectable: tests drive
    time by hand. `total` may be set later (`set_total`) by the code that knows it; without it the percentage is
    the `fraction` passed to update() (e.g. the share of the input bytes read)."""

    def __init__(self, verb, unit, total=None, rate_unit=None, interval=1.0, clock=time.monotonic, stream=None):
        self.verb, self.unit, self.rate_unit = verb, unit, rate_unit or unit
        self.total, self.interval, self.clock = total, interval, clock
        self.stream = stream            # None: sys.stderr at print time
        self.done, self.nbytes = 0, 0
        self.start = self.last = clock()

    def set_total(self, total):
        self.total = total

    def advance(self, count=1, nbytes=0):
        self.update(self.done + count, self.nbytes + nbytes)

    def update(self, done, nbytes=None, fraction=None, may_print=True):
        """Set the counts (absolute); print a line if `may_print` and `interval` seconds have passed."""
        self.done = done
        if nbytes is not None:
            self.nbytes = nbytes
        if not may_print:
            return
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._print(self.line(now - self.start, fraction))

    def line(self, elapsed, fraction=None):
        elapsed = max(elapsed, 1e-9)
        if fraction is None and self.total:
            fraction = self.done / self.total
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        text = f"{self.verb} {count} {self.unit}" + (f" ({100 * fraction:.0f}%)" if fraction is not None else "")
        text += f", {self.done / elapsed:.0f} {self.rate_unit}/s"
        return text + (f", {self.nbytes / elapsed / 1e6:.2f} MB/s" if self.nbytes else "")

    def summary(self, counts="", details="", trailer=""):
        """'Done: N unit{counts}, X MB in S s (R unit/s, M MB/s{details}){trailer}'; the elapsed seconds stay in
        `self.seconds`."""
        self.seconds = max(self.clock() - self.start, 1e-9)
        return (f"Done: {self.done} {self.unit}{counts}, {self.nbytes / 1e6:.1f} MB in {self.seconds:.1f} s "
                f"({self.done / self.seconds:.0f} {self.rate_unit}/s, {self.nbytes / self.seconds / 1e6:.2f} MB/s"
                f"{details}){trailer}")

    def finish(self, counts="", details="", trailer=""):
        """Print the summary (and return it)."""
        text = self.summary(counts, details, trailer)
        self._print(text)
        return text

    def _print(self, text):
        print(text, file=self.stream or sys.stderr, flush=True)
