#!/usr/bin/env bash
# GPT-2 pretraining on one GPU (or CPU process), Megatron's own path (no ZeRO).
#
#   bash scripts/pretrain_gpt.sh                                   # tiny GPT-2 on CPU, or GPT-2 124M on a GPU
#   NUM_LAYERS=24 HIDDEN_SIZE=1024 NUM_HEADS=16 bash scripts/pretrain_gpt.sh   # 345M
#
# Reads: PYTHON, NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH MICRO_BATCH TRAIN_ITERS LR PRECISION_ARGS (--fp16|--bf16),
#        DATA_PATH VOCAB_FILE MERGE_FILE or DATA_ARGS, CHECKPOINT_PATH (default checkpoints/gpt2), EXTRA_ARGS.
source "$(dirname "$0")/_common.sh"
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2}

launch 1 pretrain_gpt.py $MODEL_ARGS $TRAINING_ARGS $BATCH_PRECISION_ARGS $DATA_ARGS \
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" ${EXTRA_ARGS:-}
