#!/usr/bin/env bash
# Llama-shaped pretraining (RoPE, SwiGLU, RMSNorm, grouped-query attention, untied head, no biases: docs/models.md)
# on one GPU (or CPU process), Megatron's own path; the same flags work in every other script via EXTRA_ARGS.
#
#   bash scripts/pretrain_llama.sh                 # tiny Llama on CPU (L2 h128, 4 heads / 2 kv heads), or ~1.1B on a GPU
#   NUM_KV_HEADS=8 FFN_HIDDEN_SIZE=11008 NUM_LAYERS=32 HIDDEN_SIZE=4096 NUM_HEADS=32 bash scripts/pretrain_llama.sh
#
# Reads: what scripts/pretrain_gpt.sh reads, plus NUM_KV_HEADS FFN_HIDDEN_SIZE ROPE_THETA; CHECKPOINT_PATH
#        (default checkpoints/llama).
SHAPE_FROM_USER="${NUM_LAYERS-}:${HIDDEN_SIZE-}:${NUM_HEADS-}:${SEQ_LENGTH-}"
source "$(dirname "$0")/_common.sh"
if [ "$NUM_GPUS" -gt 0 ]; then   # TinyLlama 1.1B's shape unless the shape was given
  if [ "$SHAPE_FROM_USER" = ":::" ]; then
    NUM_LAYERS=22; HIDDEN_SIZE=2048; NUM_HEADS=32; SEQ_LENGTH=2048
    MODEL_ARGS="--num-layers $NUM_LAYERS --hidden-size $HIDDEN_SIZE --num-attention-heads $NUM_HEADS \
      --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH"
  fi
  NUM_KV_HEADS=${NUM_KV_HEADS:-4}; FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-5632}
else
  NUM_KV_HEADS=${NUM_KV_HEADS:-2}; FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-352}
fi
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama}
LLAMA_ARGS="--swiglu --ffn-hidden-size $FFN_HIDDEN_SIZE --num-key-value-heads $NUM_KV_HEADS \
  --use-rotary-position-embeddings --rotary-position-embeddings-theta ${ROPE_THETA:-10000} --no-position-embedding \
  --normalization rmsnorm --layernorm-epsilon 1e-5 --disable-bias-linear --untie-embeddings-and-output-weights"

launch 1 pretrain_gpt.py $MODEL_ARGS $LLAMA_ARGS $TRAINING_ARGS $BATCH_PRECISION_ARGS $DATA_ARGS \
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" ${EXTRA_ARGS:-}
