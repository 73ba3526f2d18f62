#!/usr/bin/env bash
# GPT-2 pretraining on one GPU (or one CPU process) through the integrated ZeRO-2 engine (--deepspeed).
#
#   bash scripts/ds_pretrain_gpt.sh                  # tiny GPT-2 on CPU (fp32 ZeRO-2), GPT-2 124M on a GPU (bf16)
#   DS_CONFIG=my_ds_config.json bash scripts/ds_pretrain_gpt.sh
#   Many nodes: use scripts/ds_zero2_pretrain_gpt_model_parallel.sh.
#
# Micro batch, gradient accumulation, clipping and precision come from the JSON config (DS_CONFIG, default
# scripts/ds_zero2_config.json on CPU, scripts/ds_zero2_config_bf16.json on GPU); a command-line flag that disagrees
# with it is an error. The JSON's optimizer/scheduler keys (lr, weight_decay, betas, a scheduler block) replace the
# recipe's defaults for them (--lr, the cosine schedule, --weight-decay, --adam-beta2); an LR you set must agree.
# Reads: PYTHON, DS_CONFIG, NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH TRAIN_ITERS LR,
# DATA_PATH VOCAB_FILE MERGE_FILE or DATA_ARGS, CHECKPOINT_PATH (default checkpoints/gpt2_zero2), EXTRA_ARGS,
# LOG_JSONL (default $CHECKPOINT_PATH/log.jsonl, appended to on resume; empty: none). The run ends by plotting the
# log next to the checkpoint and printing where (run.png, run.html: tools/plot_run.py; matplotlib is a requirement).
source "$(dirname "$0")/_common.sh"
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_zero2}
LOG_JSONL=${LOG_JSONL-$CHECKPOINT_PATH/log.jsonl}
LOG_ARGS=""
if [ -n "$LOG_JSONL" ]; then mkdir -p "$(dirname "$LOG_JSONL")"; LOG_ARGS="--log-jsonl $LOG_JSONL"; fi

launch 1 pretrain_gpt.py $MODEL_ARGS $(json_decided_training_args) $DATA_ARGS \
  --deepspeed --deepspeed_config "$DS_CONFIG" --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" $LOG_ARGS \
  ${EXTRA_ARGS:-}
echo "checkpoint: $CHECKPOINT_PATH (latest: $(cat "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" 2>/dev/null))"
echo "resume: run the same command again (it loads $CHECKPOINT_PATH); raise TRAIN_ITERS to train further"
if [ -n "$LOG_JSONL" ]; then plot_log "$LOG_JSONL" "$CHECKPOINT_PATH"; fi
