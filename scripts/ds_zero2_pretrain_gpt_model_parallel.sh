#!/usr/bin/env bash
# GPT-2 pretraining across GPUs and nodes: tensor model parallelism x ZeRO-2 data parallelism (--deepspeed).
#
# One node:   bash scripts/ds_zero2_pretrain_gpt_model_parallel.sh
# Many nodes: run on every node with the same MASTER_ADDR (node 0's address) and MASTER_PORT, e.g. two nodes:
#             NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/ds_zero2_pretrain_gpt_model_parallel.sh  # node 0
#             NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/ds_zero2_pretrain_gpt_model_parallel.sh  # node 1
# World = GPUS_PER_NODE x NNODES = MP_SIZE x data-parallel size. Without GPUs: 4 CPU processes per node (gloo),
# MP_SIZE 2, a tiny GPT-2.
#
# Reads: GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT MP_SIZE, DS_CONFIG, and what ds_pretrain_gpt.sh reads.
# PP_SIZE (pipeline stages, default 1: ZeRO-2 as above). PP_SIZE > 1 allows ZeRO stages 0-1 only (DeepSpeed's rule):
# the default config is then DS_CONFIG with stage 1 and gradient_accumulation_steps ACCUMULATION (default 4, the
# micro-batches per step), written under CHECKPOINT_PATH. Checkpoints carry the stage in their names and load at
# another PP_SIZE too.
# With DEEPSPEED_ACTIVATION_CHECKPOINTING=1: --checkpoint-activations --deepspeed_activation_checkpointing
# (checkpointed activations partitioned across the model-parallel ranks).
source "$(dirname "$0")/_common.sh"
if [ "$NUM_GPUS" -gt 0 ]; then GPUS_PER_NODE=${GPUS_PER_NODE:-$NUM_GPUS}; else GPUS_PER_NODE=${GPUS_PER_NODE:-4}; fi
MP_SIZE=${MP_SIZE:-2}
PP_SIZE=${PP_SIZE:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_zero2_mp$MP_SIZE}
CHECKPOINT_ARGS="--save $CHECKPOINT_PATH --load $CHECKPOINT_PATH"
if [ "$PP_SIZE" -gt 1 ]; then
  mkdir -p "$CHECKPOINT_PATH"
  "$PYTHON" - "$DS_CONFIG" "$CHECKPOINT_PATH/ds_config_pp.json" "${ACCUMULATION:-4}" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["zero_optimization"]["stage"] = 1
config["gradient_accumulation_steps"] = int(sys.argv[3])
config.pop("train_batch_size", None)
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY
  DS_CONFIG="$CHECKPOINT_PATH/ds_config_pp.json"
  echo "PP_SIZE=$PP_SIZE: ZeRO stage 1 ($DS_CONFIG)"
fi
AC_ARGS=""
if [ "${DEEPSPEED_ACTIVATION_CHECKPOINTING:-0}" = "1" ]; then
  AC_ARGS="--checkpoint-activations --deepspeed_activation_checkpointing"
fi

launch "$GPUS_PER_NODE" pretrain_gpt.py --model-parallel-size "$MP_SIZE" --pipeline-model-parallel-size "$PP_SIZE" \
  $MODEL_ARGS $(json_decided_training_args) $DATA_ARGS --deepspeed --deepspeed_config "$DS_CONFIG" $AC_ARGS \
  $CHECKPOINT_ARGS ${EXTRA_ARGS:-}
