#!/usr/bin/env bash
# The GPU check: one command for a CUDA machine, at most ~10 minutes.
#
#   bash tools/gpu_check.sh                       # (a) equivalence tests on CUDA, (b) one-GPU benchmark table
#   bash tools/gpu_check.sh --bench-only --models 124m --precisions bf16
#   bash tools/gpu_check.sh --dry-run             # print the plan and the two commands and exit (works without a GPU)
#
# (a) runs the device-agnostic equivalence tests (mpu vs single process, GPT2Model vs Hugging Face, ZeRO 0-2 vs torch
#     AdamW, activation checkpointing, exact resume) with `pytest --device cuda` (tests/conftest.py), one NCCL rank
#     per GPU: a test needing more ranks than the machine has GPUs is skipped and named in the summary (one GPU:
#     only the single-rank tests run);
# (b) runs tools/bench/bench_gpu.py: GPT-2 124M and ~1.3B on one GPU, bf16 and fp16, ZeRO-2 and stage 3 where the engine
#     accepts it (--stages 2 to leave it out): tokens/s, TFLOP/s, MFU, max_memory_allocated against the ZeRO formula.
# The test summary and the benchmark table come last. Logs: $LOG_DIR (default runs/gpu_check/). Reads PYTHON
# (default .venv/bin/python, else python3), TEST_TIMEOUT (240 s), BENCH_TIMEOUT (330 s) and GPU_COUNT (default: the
# GPUs torch sees; set it to see the plan for another machine with --dry-run).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOG_DIR=${LOG_DIR:-runs/gpu_check}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
TESTS="tests/model/test_mpu.py tests/model/test_gpt2_model.py tests/zero/test_zero_engine.py tests/zero/test_activation_checkpointing.py
tests/checkpoint/test_zero_checkpoint.py"
RUN_TESTS=1 RUN_BENCH=1 DRY_RUN=0
BENCH_ARGS=()

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --tests-only) RUN_BENCH=0 ;;
    --bench-only) RUN_TESTS=0 ;;
    --dry-run) DRY_RUN=1 ;;
    --models|--precisions|--stages|--steps|--micro-batch|--peak-tflops)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (e.g. $1 $(case "$1" in --models) echo 124m;;
        --precisions) echo bf16;; --stages) echo 2;; *) echo 10;; esac))"
      BENCH_ARGS+=("$1" "$2"); shift ;;
    --checkpoint-activations) BENCH_ARGS+=("$1") ;;
    *) die "unknown option '$1': see bash tools/gpu_check.sh --help" ;;
  esac
  shift
done
[ "$RUN_TESTS$RUN_BENCH" != "00" ] || die "--tests-only and --bench-only together leave nothing to run: pass one"
case "$TEST_TIMEOUT$BENCH_TIMEOUT" in *[!0-9]*) die "TEST_TIMEOUT/BENCH_TIMEOUT must be whole seconds" ;; esac
case "${GPU_COUNT-}" in *[!0-9]*) die "GPU_COUNT must be a whole number of GPUs (e.g. GPU_COUNT=8)" ;; esac

gpu_count() { "$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
# What (a) runs with $1 GPUs: megatron/spawn.py puts rank r on GPU r and skips a test with more ranks than GPUs.
plan() {
  case "$1" in
    0) echo "plan: no GPU visible: (a) needs at least one (the run stops at the CUDA check)" ;;
    1) echo "plan: 1 GPU: single-rank tests only; every multi-rank test is skipped (one NCCL rank per GPU)" ;;
    *) echo "plan: $1 GPUs: tests with up to $1 ranks, one NCCL rank per GPU; tests with more ranks are skipped" ;;
  esac
}

TEST_CMD=("$PYTHON" -m pytest -q -rs --device cuda $TESTS)
BENCH_CMD=("$PYTHON" tools/bench/bench_gpu.py --json "$LOG_DIR/bench_gpu.json" "${BENCH_ARGS[@]}")
if [ "$DRY_RUN" = 1 ]; then
  [ "$RUN_TESTS" = 1 ] && plan "${GPU_COUNT:-$(gpu_count)}" && echo "timeout $TEST_TIMEOUT ${TEST_CMD[*]}"
  [ "$RUN_BENCH" = 1 ] && echo "timeout $BENCH_TIMEOUT ${BENCH_CMD[*]}"
  exit 0
fi

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False with $PYTHON): run it on a GPU machine" >&2
  exit 1; }
mkdir -p "$LOG_DIR"
"$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'# {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')" \
  | tee "$LOG_DIR/device.txt"

TEST_RC=skipped BENCH_RC=skipped
if [ "$RUN_TESTS" = 1 ]; then
  plan "$(gpu_count)" | tee "$LOG_DIR/plan.txt"
  echo "== (a) equivalence tests on CUDA (log: $LOG_DIR/tests.log)"
  timeout "$TEST_TIMEOUT" "${TEST_CMD[@]}" > "$LOG_DIR/tests.log" 2>&1; TEST_RC=$?
  [ "$TEST_RC" = 124 ] && echo "tests timed out after $TEST_TIMEOUT s" >> "$LOG_DIR/tests.log"
fi
if [ "$RUN_BENCH" = 1 ]; then
  echo "== (b) one-GPU benchmark (log: $LOG_DIR/bench.log)"
  timeout "$BENCH_TIMEOUT" "${BENCH_CMD[@]}" > "$LOG_DIR/bench.log" 2>&1; BENCH_RC=$?
  [ "$BENCH_RC" = 124 ] && echo "benchmark timed out after $BENCH_TIMEOUT s (rows so far below)" >> "$LOG_DIR/bench.log"
fi

echo
cat "$LOG_DIR/device.txt"
if [ "$RUN_TESTS" = 1 ]; then
  cat "$LOG_DIR/plan.txt"
  echo "tests (exit $TEST_RC): $(grep -E '(passed|failed|error)' "$LOG_DIR/tests.log" | tail -1)"
  # pytest -rs: 'SKIPPED [n] file:line: 2 NCCL ranks need 2 GPUs (one rank per GPU); this machine has 1'
  grep -E '^SKIPPED .*NCCL ranks need' "$LOG_DIR/tests.log" | sed 's/^/  /' 
fi
if [ "$RUN_BENCH" = 1 ]; then
  echo "benchmark (exit $BENCH_RC):"
  # the table bench_gpu prints at the end, or the rows it printed before a timeout
  "$PYTHON" tools/bench/bench_gpu.py --print-log "$LOG_DIR/bench.log"
fi
[ "$TEST_RC" = 0 ] || [ "$TEST_RC" = skipped ] || exit 1
[ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ] || exit 1
