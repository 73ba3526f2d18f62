# Shared defaults for the launch scripts (sourced, not run). Every value can be overridden from the environment.
#
# Device: with a GPU, GPUS_PER_NODE defaults to the GPU count and the model to GPT-2 124M; without one, CPU
# processes with gloo and a tiny GPT-2 so the scripts run as-is on a laptop or CI machine.
# Data: the embedded default corpus under data/webtext/ (built on first use by tools/prepare_default_data.py),
# or DATA_PATH/VOCAB_FILE/MERGE_FILE for your own preprocessed data (or a directory or file of raw .jsonl/.jsonl.gz/
# .json/.parquet shards, streamed), or DATA_ARGS="--mock-data" for none.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# CUDA hidden (CUDA_VISIBLE_DEVICES empty or -1) or no GPU driver device: 0 GPUs without a ~2 s torch import.
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ] || [ "${CUDA_VISIBLE_DEVICES-unset}" = "-1" ] \
   || { [ ! -e /dev/nvidiactl ] && [ ! -e /dev/kfd ]; }; then
  NUM_GPUS=0
else
  NUM_GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
fi

# What the user set (before the recipe's defaults fill them in): under --deepspeed a DS_CONFIG's optimizer/scheduler
# keys win over the recipe's defaults, never over these (json_decided_training_args).
USER_LR=${LR:-}; USER_RECIPE_ARGS=${RECIPE_ARGS+set}

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# One node without MASTER_PORT: torchrun --standalone picks a free port itself (a fixed 6000 may be another job's).
# Many nodes need the same MASTER_PORT on every node (default 6000); node 0 checks that it is free before launching.
if [ "$NNODES" -gt 1 ]; then MASTER_PORT=${MASTER_PORT:-6000}; fi

if [ "$NUM_GPUS" -gt 0 ]; then
  DEFAULT_GPUS=$NUM_GPUS
  NUM_LAYERS=${NUM_LAYERS:-12}; HIDDEN_SIZE=${HIDDEN_SIZE:-768}; NUM_HEADS=${NUM_HEADS:-12}
  SEQ_LENGTH=${SEQ_LENGTH:-1024}; MICRO_BATCH=${MICRO_BATCH:-8}; TRAIN_ITERS=${TRAIN_ITERS:-5000}
  PRECISION_ARGS=${PRECISION_ARGS:---bf16}
  LR=${LR:-6e-4}
  RECIPE_ARGS=${RECIPE_ARGS:-}
else
  # The CPU recipe, tuned for validation perplexity within ~6 minutes of training on 2 cores (README): a small
  # model on many tokens (L2 h128 at batch 32 reached 187, L4 h256 at batch 16 367 in the same time; lr 2e-3 beat
  # 3e-3 and 5e-3), fp32 (not every CPU has native bf16), no dropout and Adam beta2 0.95 (a short run under one
  # epoch does not overfit). On the --deepspeed path the micro batch is scripts/ds_zero2_config.json's.
  DEFAULT_GPUS=1
  NUM_LAYERS=${NUM_LAYERS:-2}; HIDDEN_SIZE=${HIDDEN_SIZE:-128}; NUM_HEADS=${NUM_HEADS:-4}
  SEQ_LENGTH=${SEQ_LENGTH:-128}; MICRO_BATCH=${MICRO_BATCH:-32}; TRAIN_ITERS=${TRAIN_ITERS:-420}
  PRECISION_ARGS=${PRECISION_ARGS:-}
  LR=${LR:-2e-3}
  RECIPE_ARGS=${RECIPE_ARGS:---hidden-dropout 0 --attention-dropout 0 --adam-beta2 0.95}
  EVAL_INTERVAL=${EVAL_INTERVAL:-100}
fi
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

if [ -z "${DATA_ARGS:-}" ]; then
  DATA_PATH=${DATA_PATH:-data/webtext/webtext_text_document}
  VOCAB_FILE=${VOCAB_FILE:-data/webtext/vocab.json}
  MERGE_FILE=${MERGE_FILE:-data/webtext/merges.txt}
  if [ "$DATA_PATH" = "data/webtext/webtext_text_document" ] && [ ! -f "$DATA_PATH.idx" ]; then
    "$PYTHON" tools/prepare_default_data.py
  fi
  DATA_ARGS="--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1"
  case "$DATA_PATH" in   # raw shards, streamed (docs/data.md): the eod between documents, as the default data has
    *.jsonl|*.jsonl.gz|*.json|*.parquet) DATA_ARGS="$DATA_ARGS --append-eod" ;;
    *) if [ -d "$DATA_PATH" ]; then DATA_ARGS="$DATA_ARGS --append-eod"; fi ;;
  esac
fi

MODEL_ARGS="--num-layers $NUM_LAYERS --hidden-size $HIDDEN_SIZE --num-attention-heads $NUM_HEADS \
  --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH"
# Shared by every script; the Megatron path adds BATCH_PRECISION_ARGS, the --deepspeed path reads those from its JSON.
SCHEDULE_ARGS="--min-lr 1e-5 --lr-decay-style cosine --warmup 0.01"
TRAINING_ARGS="--train-iters $TRAIN_ITERS --lr $LR $SCHEDULE_ARGS \
  --weight-decay 0.01 --log-interval $LOG_INTERVAL --eval-interval $EVAL_INTERVAL --eval-iters $EVAL_ITERS \
  --save-interval $SAVE_INTERVAL $RECIPE_ARGS"
BATCH_PRECISION_ARGS="--batch-size $MICRO_BATCH --clip-grad 1.0 $PRECISION_ARGS"
if [ "$NUM_GPUS" -gt 0 ]; then
  DS_CONFIG=${DS_CONFIG:-scripts/ds_zero2_config_bf16.json}
else
  DS_CONFIG=${DS_CONFIG:-scripts/ds_zero2_config.json}
fi

json_decided_training_args() {  # TRAINING_ARGS less the recipe defaults that DS_CONFIG's optimizer/scheduler set
  # A JSON key and a flag for the same value must agree (pretrain_gpt.py stops naming both), so the recipe's own
  # defaults (--lr, the cosine schedule, --weight-decay, the CPU recipe's --adam-beta2) give way to the JSON's
  # keys; an LR or RECIPE_ARGS the user set is still passed, and a disagreement with the JSON stops the run.
  local decided args=" $TRAINING_ARGS "
  decided=$("$PYTHON" - "$DS_CONFIG" <<'JSON_KEYS'
import json, sys
try:
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    params = (config.get("optimizer") or {}).get("params") or {}
    scheduler = config.get("scheduler")
except (OSError, ValueError, AttributeError):
    sys.exit(0)             # pretrain_gpt.py names what is wrong with the file
keys = [key for key in ("weight_decay", "betas") if key in params]
keys += ["lr"] if "lr" in params or "adam_lr" in params or scheduler else []
print(" ".join(keys + (["scheduler"] if scheduler else [])))
JSON_KEYS
)
  for key in $decided; do
    case $key in
      lr) if [ -z "$USER_LR" ]; then args=${args/ --lr $LR / }; fi ;;
      scheduler) args=${args/ $SCHEDULE_ARGS / } ;;
      weight_decay) args=${args/ --weight-decay 0.01 / } ;;
      betas) if [ -z "$USER_RECIPE_ARGS" ]; then args=${args/--adam-beta2 0.95/}; fi ;;
    esac
  done
  echo "$args"
}

check_port_free() {  # a port this node must listen on: one line naming it when another process holds it
  if ! "$PYTHON" - "$1" <<'PORT_CHECK'
import errno, socket, sys
with socket.socket() as probe:
    try:
        probe.bind(("", int(sys.argv[1])))   # every address of this node, as torchrun's store listens
    except OSError as error:
        sys.exit(1 if error.errno == errno.EADDRINUSE else 0)
PORT_CHECK
  then
    echo "error: MASTER_PORT $1 is already in use on this machine (another job?): choose another MASTER_PORT," \
      "or on one node leave it unset to pick a free port" >&2
    exit 1
  fi
}

# A worker that dies (a lost node, a SIGKILL) restarts the whole group from the newest complete checkpoint in --save,
# up to MAX_RESTARTS times (default 3 on GPU, 0 on CPU). Restarts need torchrun's c10d rendezvous (a static one
# cannot re-form the group), which --standalone uses on one node.
if [ "$NUM_GPUS" -gt 0 ]; then MAX_RESTARTS=${MAX_RESTARTS:-3}; else MAX_RESTARTS=${MAX_RESTARTS:-0}; fi

launch() {  # launch NPROC_PER_NODE ARGS... : torchrun on this node
  local nproc=$1; shift
  if [ "$nproc" -eq 1 ] && [ "$NNODES" -eq 1 ] && [ "$MAX_RESTARTS" -eq 0 ] && [ -z "${MASTER_PORT:-}" ]; then
    # One process, nothing to restart: the script itself, without torchrun's agent (a second Python importing
    # torch); megatron's init then uses an in-process store, no port at all.
    "$PYTHON" -u "$@"
    return
  fi
  if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then
    "$PYTHON" -m torch.distributed.run --standalone --max-restarts "$MAX_RESTARTS" --nproc_per_node "$nproc" "$@"
    return
  fi
  if [ "$NODE_RANK" -eq 0 ]; then check_port_free "$MASTER_PORT"; fi
  if [ "$MAX_RESTARTS" -gt 0 ]; then
    "$PYTHON" -m torch.distributed.run --nproc_per_node "$nproc" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
      --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megatron}" \
      --max-restarts "$MAX_RESTARTS" "$@"
    return
  fi
  "$PYTHON" -m torch.distributed.run --nproc_per_node "$nproc" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
}

plot_log() {  # plot_log LOG_JSONL OUT_DIR: run.png and run.html of a --log-jsonl next to the checkpoint
  if ! "$PYTHON" -c "import matplotlib" 2>/dev/null; then   # a requirement (make install); one line if it is missing
    echo "plot: not written: matplotlib is missing from $PYTHON (pip install -r requirements.txt); the log is $1"
    return
  fi
  "$PYTHON" tools/plot_run.py "$1" --output "$2/run.png" --html "$2/run.html" >/dev/null \
    && echo "plot: $2/run.png and $2/run.html (from $1)" || echo "plot: tools/plot_run.py failed (above); the log is $1"
}
