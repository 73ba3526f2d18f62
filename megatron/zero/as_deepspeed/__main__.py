"""python -m megatron.zero.as_deepspeed script.py [args] | -m module [args]: run an unmodified DeepSpeed client
with `import deepspeed` resolving to megatron.zero (see __init__.py), as `python script.py [args]` would run it."""
import os
import runpy
import sys

from megatron.zero.as_deepspeed import install

USAGE = "usage: python -m megatron.zero.as_deepspeed (script.py | -m module) [args ...]"


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nRuns the DeepSpeed client script (or module) with `import deepspeed` resolving to "
              "megatron.zero; the arguments after it are the script's own.")
        return 0
    if not argv or argv == ["-m"]:
        print(f"{USAGE} (see --help)", file=sys.stderr)
        return 2
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))    # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
