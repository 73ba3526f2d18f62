#!/usr/bin/env bash
# GPT-2 pretraining across GPUs and nodes with tensor model parallelism, Megatron's own path (no ZeRO).
#
# One node:   bash scripts/pretrain_gpt_distributed_with_mp.sh
# Two nodes:  on each node, with the same MASTER_ADDR (node 0's address) and MASTER_PORT:
#             NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_gpt_distributed_with_mp.sh   # node 0
#             NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_gpt_distributed_with_mp.sh   # node 1
#
# Reads: GPUS_PER_NODE (default: GPU count; 2 CPU processes without GPUs), NNODES NODE_RANK MASTER_ADDR MASTER_PORT,
#        MP_SIZE (model-parallel size, default 2), and everything scripts/pretrain_gpt.sh reads.
source "$(dirname "$0")/_common.sh"
if [ "$NUM_GPUS" -gt 0 ]; then GPUS_PER_NODE=${GPUS_PER_NODE:-$NUM_GPUS}; else GPUS_PER_NODE=${GPUS_PER_NODE:-2}; fi
MP_SIZE=${MP_SIZE:-2}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_mp$MP_SIZE}

launch "$GPUS_PER_NODE" pretrain_gpt.py --model-parallel-size "$MP_SIZE" --DDP-impl local \
  $MODEL_ARGS $TRAINING_ARGS $BATCH_PRECISION_ARGS $DATA_ARGS --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" ${EXTRA_ARGS:-}
