#!/usr/bin/env bash
# GPT-2 pretraining across GPUs and nodes with tensor model parallelism, Megatron's own path (no ZeRO).
#
# One node:   bash scripts/pretrain_gpt_distributed_with_mp.sh
# Two nodes:  on each node, with the same MASTER_ADDR (node 0's address) and MASTER_PORT:
#             NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_gpt_distributed_with_mp.sh   # node 0
#             NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_gpt_distributed_with_mp.sh   # node 1
#
# Reads: GPUS_PER_NODE (default: GPU count; 2 CPU processes without GPUs), NNODES NODE_RANK MASTER_ADDR MASTER_PORT,
#        MP_SIZE (model-parallel size, default 2), PP_SIZE (pipeline stages, default 1; NUM_LAYERS must divide by
#        it, world = PP_SIZE x MP_SIZE x data-parallel size), and everything scripts/pretrain_gpt.sh reads.
#        Under pipelining, GLOBAL_BATCH (default 4 x MICRO_BATCH x data-parallel size) sets the micro-batches per
#        step: GLOBAL_BATCH / (MICRO_BATCH x data-parallel size); more of them shrink the 1F1B bubble.
source "$(dirname "$0")/_common.sh"
if [ "$NUM_GPUS" -gt 0 ]; then GPUS_PER_NODE=${GPUS_PER_NODE:-$NUM_GPUS}; else GPUS_PER_NODE=${GPUS_PER_NODE:-2}; fi
MP_SIZE=${MP_SIZE:-2}
PP_SIZE=${PP_SIZE:-1}
if [ "$PP_SIZE" -gt 1 ]; then
  CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_mp${MP_SIZE}_pp$PP_SIZE}
  DP_SIZE=$(( GPUS_PER_NODE * NNODES / (MP_SIZE * PP_SIZE) ))
  EXTRA_ARGS="--global-batch-size ${GLOBAL_BATCH:-$(( 4 * MICRO_BATCH * (DP_SIZE > 0 ? DP_SIZE : 1) ))} ${EXTRA_ARGS:-}"
fi
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_mp$MP_SIZE}

launch "$GPUS_PER_NODE" pretrain_gpt.py --model-parallel-size "$MP_SIZE" --pipeline-model-parallel-size "$PP_SIZE" \
  --DDP-impl local \
  $MODEL_ARGS $TRAINING_ARGS $BATCH_PRECISION_ARGS $DATA_ARGS --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" ${EXTRA_ARGS:-}
