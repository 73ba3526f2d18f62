#!/usr/bin/env bash
# The GPU check: the one command to run when a CUDA machine is at hand; at most ~8 minutes on one H200.
#
#   bash tools/gpu_check.sh                   # (a) device-agnostic tests on CUDA, (b) the one-GPU GPT-2 benchmark,
#                                             #   then (c) a DeepSpeed-style Hugging Face client
#   bash tools/gpu_check.sh --dry-run         # the plan, its commands and expected time; runs nothing (works anywhere)
#   bash tools/gpu_check.sh --tests-only      # or --bench-only, --client-only; (b)'s options pass on to bench_gpu.py:
#                                             #   --models 124m
#                                             #   --precisions bf16 --stages 2,3 --steps 20 --micro-batch 8
#                                             #   --peak-tflops 989.5 --checkpoint-activations
#
# (a) pytest --device cuda (tests/conftest.py) on the device-agnostic tests: mpu layers and collectives, GPT2Model vs
#     Hugging Face, ZeRO vs torch AdamW, activation checkpointing, exact resume, the chunked loss, the static-cache
#     decode under CUDA graphs, a ring-attention block on the flash kernel, MoE, Muon; one NCCL rank per GPU.
# (b) tools/bench/bench_gpu.py: GPT-2 124M and 350M, bf16, ZeRO-2 and ZeRO-3 on one GPU, each cell a fresh process
#     on a free port: tokens/s, MFU (the peak looked up by exact device name), peak memory against the estimate;
#     then tools/bench/bench_generate.py: GPT-2 124M bf16 greedy generation at batch 1, 8, 32 against HF generate;
#     then issue 54's targets, each marked met, missed or not measured (tools/bench/gpu_targets.py).
# (c) tools/ds_client_check.py: a Hugging Face GPT-2 built on the CPU, deepspeed.initialize through our alias, bf16,
#     ZeRO-2 and ZeRO-3, a few steps, then engine.generate and module.generate (the Hybrid Engine), on one GPU.
# Each part's result goes to $LOG_DIR/summary.txt as soon as the part ends, and (b)'s rows to bench_gpu.json as
# they are measured: a later failure, timeout or kill keeps them. Reads PYTHON (default .venv/bin/python, else
# python3), LOG_DIR (runs/gpu_check), TEST_TIMEOUT (90 s), CELL_TIMEOUT (75 s), BENCH_TIMEOUT (270 s),
# GENERATE_TIMEOUT (60 s), CLIENT_TIMEOUT (45 s), GPU_COUNT (default: the GPUs torch sees; a dry run without any
# plans for one).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOG_DIR=${LOG_DIR:-runs/gpu_check}
TEST_TIMEOUT=${TEST_TIMEOUT:-90}
CELL_TIMEOUT=${CELL_TIMEOUT:-75}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-270}
GENERATE_TIMEOUT=${GENERATE_TIMEOUT:-60}
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-45}
START_S=15          # device queries and the table: the seconds of the check outside (a), (b) and (c)
TESTS_1GPU_S=75     # (a)'s seconds on one H200: 30 s measured 2026-12-04 for the first five files, + 30 s guessed for
                    # those added since (CUDA-graph captures of the static decode, the ring block, MoE, Muon, loss),
                    # + 15 s guessed for test_moe_host_reads.py's six 1-rank workers (CUDA start-up each)
TESTS_NGPU_S=150    # with more GPUs (multi-rank tests run too): a guess until a multi-GPU run measures it
GENERATE_S=40       # (b)'s generation benchmark: a guess (3 batches x 2 repeats x 128 tokens, HF's ~160 tokens/s at
                    # batch 1 the slowest part)
CLIENT_S=20         # (c)'s expected seconds (a guess: ~28 s on this 2-core CPU, most of it importing transformers)
TESTS="tests/model/test_mpu.py tests/model/test_gpt2_model.py tests/zero/test_zero_engine.py tests/zero/test_activation_checkpointing.py
tests/checkpoint/test_zero_checkpoint.py tests/model/test_chunked_cross_entropy.py tests/inference/test_static_decode.py
tests/model/test_context_parallel_attention.py tests/model/test_moe.py tests/zero/test_muon.py
tests/model/test_moe_host_reads.py"
RUN_TESTS=1 RUN_BENCH=1 RUN_CLIENT=1 DRY_RUN=0
BENCH_ARGS=()

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --tests-only) RUN_BENCH=0 RUN_CLIENT=0 ;;
    --bench-only) RUN_TESTS=0 RUN_CLIENT=0 ;;
    --client-only) RUN_TESTS=0 RUN_BENCH=0 ;;
    --dry-run) DRY_RUN=1 ;;
    --models|--precisions|--stages|--steps|--micro-batch|--peak-tflops)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (e.g. $1 $(case "$1" in --models) echo 124m;;
        --precisions) echo bf16;; --stages) echo 2;; --peak-tflops) echo 989.5;; *) echo 10;; esac))"
      BENCH_ARGS+=("$1" "$2"); shift ;;
    --checkpoint-activations) BENCH_ARGS+=("$1") ;;
    *) die "unknown option '$1': see bash tools/gpu_check.sh --help" ;;
  esac
  shift
done
[ "$RUN_TESTS$RUN_BENCH$RUN_CLIENT" != "000" ] ||
  die "two of --tests-only, --bench-only and --client-only together leave nothing to run: pass one"
case "$TEST_TIMEOUT$CELL_TIMEOUT$BENCH_TIMEOUT$GENERATE_TIMEOUT$CLIENT_TIMEOUT" in
  *[!0-9]*) die "TEST_TIMEOUT/CELL_TIMEOUT/BENCH_TIMEOUT/GENERATE_TIMEOUT/CLIENT_TIMEOUT must be whole seconds" ;; esac
case "${GPU_COUNT-}" in *[!0-9]*) die "GPU_COUNT must be a whole number of GPUs (e.g. GPU_COUNT=8)" ;; esac

gpu_count() { "$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
# What (a) runs with $1 GPUs: megatron/spawn.py puts rank r on GPU r and skips a test with more ranks than GPUs.
plan() {
  case "$1" in
    0) echo "    no GPU visible: (a) needs at least one (the run stops at the CUDA check)" ;;
    1) echo "    1 GPU: every 1-rank test runs in a 1-rank NCCL group: NCCL's start-up, and collectives at world size 1"
       echo "    (test_mpu.py: all_reduce, reduce_scatter_tensor, all_gather_into_tensor, broadcast, reduce, async, in"
       echo "    fp32/bf16/fp16); the single-process tests run on the GPU without a group. Every multi-rank test is"
       echo "    skipped (NCCL refuses two ranks on one GPU): no collective crosses ranks; that needs 2 or more GPUs" ;;
    *) echo "    $1 GPUs: tests with up to $1 ranks, one NCCL rank per GPU (collectives across ranks); tests with more"
       echo "    ranks are skipped (TEST_TIMEOUT is sized for one GPU: raise it if the multi-rank tests need longer)" ;;
  esac
}

TEST_CMD=("$PYTHON" -m pytest -q -rs --device cuda $TESTS)
BENCH_CMD=("$PYTHON" tools/bench/bench_gpu.py --json "$LOG_DIR/bench_gpu.json" --cell-timeout "$CELL_TIMEOUT"
           "${BENCH_ARGS[@]}")
GENERATE_CMD=("$PYTHON" tools/bench/bench_generate.py --device cuda --dtype bfloat16 --layers 12 --hidden 768
              --heads 12 --vocab 50257 --recompute-up-to 0 --repeats 2 --no-eval --json "$LOG_DIR/generate.json")
TARGETS_CMD=("$PYTHON" tools/bench/gpu_targets.py --training "$LOG_DIR/bench_gpu.json"
             --generation "$LOG_DIR/generate.json")
CLIENT_CMD=("$PYTHON" tools/ds_client_check.py)

dry_run() {
  local gpus=${GPU_COUNT:-$(gpu_count)} expected=$START_S bench_plan
  [ "$gpus" = 0 ] && [ -z "${GPU_COUNT-}" ] && gpus=1
  echo "gpu_check dry run (nothing runs): the plan for $gpus GPU$([ "$gpus" = 1 ] || echo s)"
  if [ "$RUN_TESTS" = 1 ]; then
    local tests_s=$([ "$gpus" -gt 1 ] && echo $TESTS_NGPU_S || echo $TESTS_1GPU_S)
    expected=$((expected + tests_s))
    echo "(a) device-agnostic tests on CUDA, limit $TEST_TIMEOUT s, expected ~$tests_s s ($([ "$gpus" -gt 1 ] &&
      echo "a guess: no multi-GPU run yet" || echo "30 s measured on one H200 for the first five files, the rest a guess")):"
    echo "    $(echo $TESTS)"
    plan "$gpus"
    echo "    \$ timeout $TEST_TIMEOUT ${TEST_CMD[*]}"
  fi
  if [ "$RUN_BENCH" = 1 ]; then
    bench_plan=$("$PYTHON" tools/bench/bench_gpu.py --plan --cell-timeout "$CELL_TIMEOUT" "${BENCH_ARGS[@]}") \
      || die "bench_gpu.py --plan failed (its error is above)"
    echo "(b) GPT-2 training on one GPU through pretrain_gpt.py --deepspeed, limit $BENCH_TIMEOUT s:"
    echo "$bench_plan" | sed 's/^expected:/    expected:/'
    expected=$((expected + $(echo "$bench_plan" | sed -n 's/^expected: ~\([0-9]*\) s.*/\1/p') + GENERATE_S))
    echo "    \$ timeout $BENCH_TIMEOUT ${BENCH_CMD[*]}"
    echo "    generation (GPT-2 124M bf16, batch 1, 8, 32, 128 new tokens, ours and HF generate), limit" \
         "$GENERATE_TIMEOUT s, expected ~$GENERATE_S s (a guess):"
    echo "    \$ timeout $GENERATE_TIMEOUT ${GENERATE_CMD[*]}"
    echo "    then the targets, met / missed / not measured: ${TARGETS_CMD[*]}"
  fi
  if [ "$RUN_CLIENT" = 1 ]; then
    expected=$((expected + CLIENT_S))
    echo "(c) a DeepSpeed-style client (HF GPT-2 built on the CPU, deepspeed.initialize through our alias, bf16," \
         "ZeRO-2 and ZeRO-3, 4 steps, engine.generate), limit $CLIENT_TIMEOUT s, expected ~$CLIENT_S s (a guess):"
    echo "    \$ timeout $CLIENT_TIMEOUT ${CLIENT_CMD[*]}"
  fi
  local bound=$START_S
  [ "$RUN_TESTS" = 1 ] && bound=$((bound + TEST_TIMEOUT))
  [ "$RUN_BENCH" = 1 ] && bound=$((bound + BENCH_TIMEOUT + GENERATE_TIMEOUT))
  [ "$RUN_CLIENT" = 1 ] && bound=$((bound + CLIENT_TIMEOUT))
  echo "whole check: expected ~$(minutes $expected) min; at most $(minutes $bound) min (the limits and ~$START_S s" \
       "of device queries; the budget on one H200 is 8 min)"
}
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

if [ "$DRY_RUN" = 1 ]; then
  dry_run
  exit 0
fi

GPUS=$(gpu_count)
[ "$GPUS" -gt 0 ] || {
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False with $PYTHON): run it on a GPU machine" >&2
  exit 1; }
mkdir -p "$LOG_DIR"
SUMMARY=$LOG_DIR/summary.txt
"$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'# {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, \
CUDA {torch.version.cuda}')" > "$SUMMARY"
nvidia-smi --query-gpu=name,power.default_limit,driver_version --format=csv,noheader 2>/dev/null \
  | sed 's/^/# nvidia-smi: /' >> "$SUMMARY"
cat "$SUMMARY"

TEST_RC=skipped BENCH_RC=skipped GENERATE_RC=skipped CLIENT_RC=skipped
if [ "$RUN_TESTS" = 1 ]; then
  echo "== (a) device-agnostic tests on CUDA (log: $LOG_DIR/tests.log)"
  timeout "$TEST_TIMEOUT" "${TEST_CMD[@]}" > "$LOG_DIR/tests.log" 2>&1; TEST_RC=$?
  [ "$TEST_RC" = 124 ] && echo "tests timed out after $TEST_TIMEOUT s" >> "$LOG_DIR/tests.log"
  { plan "$GPUS"
    echo "tests (exit $TEST_RC): $(grep -E '(passed|failed|error)' "$LOG_DIR/tests.log" | tail -1)"
    # pytest -rs: 'SKIPPED [n] file:line: 2 NCCL ranks need 2 GPUs (one rank per GPU); this machine has 1'
    grep -E '^(SKIPPED .*NCCL ranks need|FAILED|ERROR)' "$LOG_DIR/tests.log" | sed 's/^/  /'
  } >> "$SUMMARY"
fi
if [ "$RUN_BENCH" = 1 ]; then
  echo "== (b) one-GPU benchmark (log: $LOG_DIR/bench.log; rows: $LOG_DIR/bench_gpu.json)"
  rm -f "$LOG_DIR/bench_gpu.json" "$LOG_DIR/generate.json"     # the targets read this run's rows only
  timeout "$BENCH_TIMEOUT" "${BENCH_CMD[@]}" > "$LOG_DIR/bench.log" 2>&1; BENCH_RC=$?
  [ "$BENCH_RC" = 124 ] && echo "benchmark timed out after $BENCH_TIMEOUT s (rows so far below)" >> "$LOG_DIR/bench.log"
  { echo "benchmark (exit $BENCH_RC):"
    # the rows bench_gpu printed as it measured them (also those before a timeout)
    "$PYTHON" tools/bench/bench_gpu.py --print-log "$LOG_DIR/bench.log"
  } >> "$SUMMARY"
  echo "== (b) generation against HF generate (log: $LOG_DIR/generate.log; rows: $LOG_DIR/generate.json)"
  timeout "$GENERATE_TIMEOUT" "${GENERATE_CMD[@]}" > "$LOG_DIR/generate.log" 2>&1; GENERATE_RC=$?
  [ "$GENERATE_RC" = 124 ] && echo "generation timed out after $GENERATE_TIMEOUT s" >> "$LOG_DIR/generate.log"
  { echo "generation (exit $GENERATE_RC):"
    grep -E '^\|' "$LOG_DIR/generate.log"
    echo "issue 54's targets:"
    "${TARGETS_CMD[@]}"
  } >> "$SUMMARY"
fi
if [ "$RUN_CLIENT" = 1 ]; then
  echo "== (c) DeepSpeed-style client (log: $LOG_DIR/client.log)"
  timeout "$CLIENT_TIMEOUT" "${CLIENT_CMD[@]}" > "$LOG_DIR/client.log" 2>&1; CLIENT_RC=$?
  [ "$CLIENT_RC" = 124 ] && echo "client timed out after $CLIENT_TIMEOUT s" >> "$LOG_DIR/client.log"
  { echo "client (exit $CLIENT_RC):"
    grep -E '^(RESULT|ds_client_check:|client timed out)' "$LOG_DIR/client.log" | sed 's/^/  /'
  } >> "$SUMMARY"
fi

echo
cat "$SUMMARY"
[ "$TEST_RC" = 0 ] || [ "$TEST_RC" = skipped ] || exit 1
[ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ] || exit 1
[ "$GENERATE_RC" = 0 ] || [ "$GENERATE_RC" = skipped ] || exit 1
[ "$CLIENT_RC" = 0 ] || [ "$CLIENT_RC" = skipped ] || exit 1
