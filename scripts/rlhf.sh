#!/usr/bin/env bash
# RLHF step 3 on the embedded data: GRPO of the `make finetune` checkpoint (LoRA, ZeRO-2) with a verifiable reward
# a tiny model can learn, the answer's length (megatron/posttrain/rlhf_rewards.py: closeness to 6 words), and the
# mean reward of sampled answers to validation questions before and after.
#
#   bash scripts/rlhf.sh                               # checkpoints/gpt2_lora -> checkpoints/gpt2_grpo (make rlhf)
#   TRAIN_ITERS=200 REWARD_FN=megatron.posttrain.rlhf_rewards:says_yes bash scripts/rlhf.sh
#
# Data: the prompts of data/sft/ (tools/prepare_sft_data.py builds it on first use). train_rlhf.py --algorithm grpo:
# every iteration a rollout of B completions (B: DS_CONFIG's train batch, 32 in scripts/ds_zero2_config.json; B /
# NUM_GENERATIONS questions of the train split,
# each answered NUM_GENERATIONS times, sampled at temperature 1, up to MAX_COMPLETION new tokens), scored, one
# optimizer step (TRL's dapo loss, beta 0: no reference model). Before and after training: the mean reward of
# EVAL_ITERS rollouts of validation questions with fixed sampling seeds (printed; validation points in the plot).
# The log is kept as CHECKPOINT_PATH/log.jsonl and plotted next to it (run.png, run.html; the script prints where).
# Rerunning resumes, or only re-evaluates, the run in CHECKPOINT_PATH (delete it to start over).
# Reads: PYTHON, BASE_CHECKPOINT (default checkpoints/gpt2_lora, LoRA rank LORA_RANK, alpha LORA_ALPHA, model shape
# NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH as make pretrain), CHECKPOINT_PATH (default checkpoints/gpt2_grpo),
# SFT_DATA_DIR (data/sft), TRAIN_ITERS (40), LR (3e-3), NUM_GENERATIONS (4), MAX_PROMPT (64), MAX_COMPLETION (24),
# REWARD_FN, EVAL_ITERS (4), LOG_INTERVAL (5), DS_CONFIG, EXTRA_ARGS.
TRAIN_ITERS=${TRAIN_ITERS:-40}
LR=${LR:-3e-3}
LOG_INTERVAL=${LOG_INTERVAL:-5}
EVAL_ITERS=${EVAL_ITERS:-4}
source "$(dirname "$0")/_common.sh"
BASE_CHECKPOINT=${BASE_CHECKPOINT:-checkpoints/gpt2_lora}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_grpo}
SFT_DATA_DIR=${SFT_DATA_DIR:-data/sft}
REWARD_FN=${REWARD_FN:-megatron.posttrain.rlhf_rewards:answer_length}
if [ ! -f "$BASE_CHECKPOINT/latest_checkpointed_iteration.txt" ]; then
  echo "error: BASE_CHECKPOINT $BASE_CHECKPOINT holds no checkpoint: run make finetune first (or set BASE_CHECKPOINT)" >&2
  exit 1
fi
if [ ! -f "$SFT_DATA_DIR/chatterbot.json" ]; then
  "$PYTHON" tools/prepare_sft_data.py --output-dir "$SFT_DATA_DIR" --vocab-dir "$(dirname "$VOCAB_FILE")"
fi
manifest() {  # manifest KEY: a value of tools/prepare_sft_data.py's manifest
  "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$SFT_DATA_DIR/chatterbot.json" "$1"
}
mkdir -p "$CHECKPOINT_PATH"
echo "== GRPO ($REWARD_FN), $TRAIN_ITERS iterations: $BASE_CHECKPOINT -> $CHECKPOINT_PATH"
launch 1 train_rlhf.py $MODEL_ARGS --lora-rank "${LORA_RANK:-8}" --lora-alpha "${LORA_ALPHA:-16}" \
  --data-path "$SFT_DATA_DIR/$(manifest data_prefix)" --split "$(manifest split)" --vocab-file "$VOCAB_FILE" \
  --merge-file "$MERGE_FILE" --load "$BASE_CHECKPOINT" --save "$CHECKPOINT_PATH" --algorithm grpo \
  --num-generations "${NUM_GENERATIONS:-4}" --reward-fn "$REWARD_FN" --max-prompt-length "${MAX_PROMPT:-64}" \
  --max-completion-length "${MAX_COMPLETION:-24}" --train-iters "$TRAIN_ITERS" --lr "$LR" --lr-decay-style constant \
  --weight-decay 0.0 --hidden-dropout 0 --attention-dropout 0 --log-interval "$LOG_INTERVAL" \
  --eval-iters "$EVAL_ITERS" --save-interval "$TRAIN_ITERS" --deepspeed --deepspeed_config "$DS_CONFIG" \
  --log-jsonl "$CHECKPOINT_PATH/log.jsonl" ${EXTRA_ARGS:-} | tee "$CHECKPOINT_PATH/train.log" \
  | grep --line-buffered -E "mean reward|iteration +[0-9]+/|error" \
  | sed -u -E 's/ \| consumed samples: +[0-9]+//; s/ \| learning rate: [^ ]+//; s/ \| clip_ratio\/[a-z_]+: [^ ]+//g; s/ \| loss scale.*//'
plot_log "$CHECKPOINT_PATH/log.jsonl" "$CHECKPOINT_PATH"
echo "checkpoint: $CHECKPOINT_PATH (LoRA rank ${LORA_RANK:-8}; load it with the same model flags and --lora-rank ${LORA_RANK:-8} --lora-alpha ${LORA_ALPHA:-16})"
