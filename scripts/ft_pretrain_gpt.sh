#!/usr/bin/env bash
# Fault-tolerant GPT-2 pretraining on one machine: torchft's lighthouse and FT_GROUPS replica groups, each its own
# torchrun of pretrain_gpt.py (ZeRO, --deepspeed) that restarts a dead worker and heals from a live group
# (docs/operations.md, "Fault-tolerant replica groups"; needs `pip install torchft`).
#
#   bash scripts/ft_pretrain_gpt.sh                       # 2 groups x 1 process, tiny GPT-2 on CPU
#   FT_GROUPS=4 NPROC_PER_GROUP=2 bash scripts/ft_pretrain_gpt.sh
#   kill -9 <a worker's pid>                              # its group restarts and heals; the others train on
#
# Reads: what scripts/ds_pretrain_gpt.sh reads (DS_CONFIG, model and data variables, EXTRA_ARGS), FT_GROUPS
# (default 2), NPROC_PER_GROUP (default 1), LIGHTHOUSE_PORT (default 29510), FT_MAX_RESTARTS (default 3),
# CHECKPOINT_PATH (default checkpoints/gpt2_ft; group G saves to $CHECKPOINT_PATH/group$G, logs to its log.jsonl).
# Across nodes: start torchft_lighthouse once (--bind 0.0.0.0:PORT) and each group's torchrun on its own nodes with
# --ft-lighthouse http://LIGHTHOUSE_HOST:PORT (docs/operations.md).
source "$(dirname "$0")/_common.sh"
FT_GROUPS=${FT_GROUPS:-2}; NPROC_PER_GROUP=${NPROC_PER_GROUP:-1}; LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
MAX_RESTARTS=${FT_MAX_RESTARTS:-3}   # _common.sh's MAX_RESTARTS is 0 on the CPU; groups must restart to heal
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_ft}
LIGHTHOUSE_BIN="$(dirname "$PYTHON")/torchft_lighthouse"
if [ ! -x "$LIGHTHOUSE_BIN" ]; then
  echo "error: torchft_lighthouse not found next to $PYTHON: pip install torchft" >&2; exit 1
fi
check_port_free "$LIGHTHOUSE_PORT"
"$LIGHTHOUSE_BIN" --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 \
  --bind "127.0.0.1:$LIGHTHOUSE_PORT" &
LIGHTHOUSE_PID=$!
trap 'kill "$LIGHTHOUSE_PID" 2>/dev/null' EXIT
PIDS=()
for ((G = 0; G < FT_GROUPS; G++)); do
  mkdir -p "$CHECKPOINT_PATH/group$G"
  # every group its own torchrun (--standalone: its own rendezvous and store on a free port)
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC_PER_GROUP" --max-restarts "$MAX_RESTARTS" \
    pretrain_gpt.py $MODEL_ARGS $(json_decided_training_args) $DATA_ARGS \
    --deepspeed --deepspeed_config "$DS_CONFIG" --ft-replica-groups "$FT_GROUPS" --ft-group-id "$G" \
    --ft-lighthouse "http://127.0.0.1:$LIGHTHOUSE_PORT" --save "$CHECKPOINT_PATH/group$G" \
    --log-jsonl "$CHECKPOINT_PATH/group$G/log.jsonl" ${EXTRA_ARGS:-} &
  PIDS+=($!)
done
STATUS=0
for PID in "${PIDS[@]}"; do wait "$PID" || STATUS=$?; done
echo "checkpoints: $CHECKPOINT_PATH/group0 .. group$((FT_GROUPS - 1)) (the same state; one resumes a plain job)"
exit $STATUS
