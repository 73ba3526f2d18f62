#!/bin/sh
# `python` for the suite's scripts and torchrun's workers (PYTHON, PYTHON_EXEC): forked from the pytest worker's
# warm interpreter where it can be (tests/warm_python.py), else the real interpreter.
if [ -z "${MEGATRON_WARM_PYTHON_REAL:-}" ]; then exec python3 "$@"; fi
exec "$MEGATRON_WARM_PYTHON_REAL" -I -S "$(dirname "$0")/warm_python.py" --shim "$@"
