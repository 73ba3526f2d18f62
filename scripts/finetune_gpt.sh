#!/usr/bin/env bash
# LoRA fine-tuning (SFT) of the `make pretrain` checkpoint through the integrated ZeRO-2 engine (--deepspeed) on the
# embedded default chat data, with the validation perplexity and three held-out answers before and after.
#
#   bash scripts/finetune_gpt.sh                       # checkpoints/gpt2_zero2 -> checkpoints/gpt2_lora (make finetune)
#   TRAIN_ITERS=300 LORA_RANK=16 bash scripts/finetune_gpt.sh
#
# Data: data/sft/ (tools/prepare_sft_data.py builds it on first use: chatterbot-corpus pairs, template
# deepspeed-chat, the default data's tokenizer). Steps: (1) the validation perplexity of BASE_CHECKPOINT (an
# evaluation-only run, --train-iters 0), (2) TRAIN_ITERS LoRA steps into CHECKPOINT_PATH, ending with the validation
# perplexity, (3) greedy answers of both checkpoints to the first three test questions (tools/generate_samples_gpt.py
# --chat-template deepspeed-chat; the LoRA checkpoint loads with the same --lora-* flags). Rerunning resumes, or only
# re-evaluates, the run in CHECKPOINT_PATH (delete it to start over). The fine-tuning run logs to
# CHECKPOINT_PATH/log.jsonl (a rerun appends its own records) and the log is plotted next to it (run.png, run.html;
# the script prints where).
# Reads: PYTHON, BASE_CHECKPOINT (default checkpoints/gpt2_zero2; made with the same model shape: NUM_LAYERS
# HIDDEN_SIZE NUM_HEADS SEQ_LENGTH), CHECKPOINT_PATH (default checkpoints/gpt2_lora), SFT_DATA_DIR (default data/sft),
# TRAIN_ITERS (default 100), LR (default 1e-2), LORA_RANK (8), LORA_ALPHA (16), EVAL_ITERS (default: the
# validation split in whole batches), DS_CONFIG, LOG_INTERVAL, OUT_SEQ_LENGTH (24), EXTRA_ARGS (appended to every
# launch: both finetune_gpt.py runs and the generation; e.g. model flags), FINETUNE_ARGS (appended to the
# finetune_gpt.py runs only: its own flags, e.g. --sample-every N --sample-prompts FILE, which generation refuses).
TRAIN_ITERS=${TRAIN_ITERS:-100}
LR=${LR:-1e-2}
USER_EVAL_ITERS=${EVAL_ITERS:-}
source "$(dirname "$0")/_common.sh"
BASE_CHECKPOINT=${BASE_CHECKPOINT:-checkpoints/gpt2_zero2}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_lora}
SFT_DATA_DIR=${SFT_DATA_DIR:-data/sft}
LORA_ARGS="--lora-rank ${LORA_RANK:-8} --lora-alpha ${LORA_ALPHA:-16}"
if [ ! -f "$BASE_CHECKPOINT/latest_checkpointed_iteration.txt" ]; then
  echo "error: BASE_CHECKPOINT $BASE_CHECKPOINT holds no checkpoint: run make pretrain first (or set BASE_CHECKPOINT)" >&2
  exit 1
fi
if [ ! -f "$SFT_DATA_DIR/chatterbot.json" ]; then
  "$PYTHON" tools/prepare_sft_data.py --output-dir "$SFT_DATA_DIR" --vocab-dir "$(dirname "$VOCAB_FILE")"
fi
manifest() {  # manifest KEY [SUBKEY]: a value of tools/prepare_sft_data.py's manifest
  "$PYTHON" -c 'import functools, json, sys; print(functools.reduce(lambda d, k: d[k], sys.argv[2:], json.load(open(sys.argv[1]))))' \
    "$SFT_DATA_DIR/chatterbot.json" "$@"
}
SPLIT=$(manifest split)
VALID_EXAMPLES=$(manifest counts valid)
EVAL_ITERS=${USER_EVAL_ITERS:-$(( VALID_EXAMPLES / MICRO_BATCH > 0 ? VALID_EXAMPLES / MICRO_BATCH : 1 ))}
SFT_DATA_ARGS="--data-path $SFT_DATA_DIR/$(manifest data_prefix) --split $SPLIT --vocab-file $VOCAB_FILE \
  --merge-file $MERGE_FILE"
FT_ARGS="--lr $LR --min-lr 1e-5 --lr-decay-style cosine --warmup 0.05 --weight-decay 0.0 --log-interval $LOG_INTERVAL \
  --eval-interval $((TRAIN_ITERS + 1)) --eval-iters $EVAL_ITERS"
DS_ARGS="--deepspeed --deepspeed_config $DS_CONFIG"
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT

echo "== 1/3 validation perplexity of $BASE_CHECKPOINT (before fine-tuning)"
launch 1 finetune_gpt.py $MODEL_ARGS $LORA_ARGS $SFT_DATA_ARGS $FT_ARGS $DS_ARGS --train-iters 0 \
  --load "$BASE_CHECKPOINT" --log-jsonl "$workdir/before.jsonl" ${FINETUNE_ARGS:-} ${EXTRA_ARGS:-} \
  > "$workdir/before.log" 2>&1 \
  || { cat "$workdir/before.log"; exit 1; }
echo "== 2/3 LoRA rank ${LORA_RANK:-8} fine-tuning, $TRAIN_ITERS iterations -> $CHECKPOINT_PATH"
launch 1 finetune_gpt.py $MODEL_ARGS $LORA_ARGS $SFT_DATA_ARGS $FT_ARGS $DS_ARGS --train-iters "$TRAIN_ITERS" \
  --load "$BASE_CHECKPOINT" --save "$CHECKPOINT_PATH" --save-interval "$TRAIN_ITERS" \
  --log-jsonl "$CHECKPOINT_PATH/log.jsonl" ${FINETUNE_ARGS:-} ${EXTRA_ARGS:-}
plot_log "$CHECKPOINT_PATH/log.jsonl" "$CHECKPOINT_PATH"
echo "== 3/3 greedy answers to three held-out test questions"
head -n 3 "$SFT_DATA_DIR/test.jsonl" > "$workdir/questions.jsonl"
"$PYTHON" -c 'import json, sys; print("\n".join(json.loads(l)["prompt"].replace("\n", " ") for l in open(sys.argv[1])))' \
  "$workdir/questions.jsonl" > "$workdir/questions.txt"
GEN_ARGS="$MODEL_ARGS --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --sample-input-file $workdir/questions.txt \
  --chat-template deepspeed-chat --greedy --out-seq-length ${OUT_SEQ_LENGTH:-24}"
launch 1 tools/generate_samples_gpt.py $GEN_ARGS --load "$BASE_CHECKPOINT" --sample-output-file "$workdir/before.txt" \
  ${EXTRA_ARGS:-} > "$workdir/gen_before.log" 2>&1 || { cat "$workdir/gen_before.log"; exit 1; }
launch 1 tools/generate_samples_gpt.py $GEN_ARGS $LORA_ARGS --load "$CHECKPOINT_PATH" \
  --sample-output-file "$workdir/after.txt" ${EXTRA_ARGS:-} > "$workdir/gen_after.log" 2>&1 \
  || { cat "$workdir/gen_after.log"; exit 1; }
"$PYTHON" - "$workdir" "$CHECKPOINT_PATH/log.jsonl" <<'SUMMARY'
import json, os, re, sys
work, log = sys.argv[1:]
def valid_ppl(path):   # the last validation record of that run's --log-jsonl (this run's: a rerun appends)
    records = [json.loads(line) for line in open(path)]
    return [r for r in records if r.get("type") == "validation" and r["split"] == "valid"][-1]["ppl"]["lm loss"]
def answers(name):
    text = open(os.path.join(work, name), encoding="utf-8").read()
    return [" ".join(a.split()) or "(empty: end-of-text first)" for a in re.findall(r"^Megatron-LM: (.*?)\n\n(?=Context: |\Z)", text, re.S | re.M)]
before, after = answers("before.txt"), answers("after.txt")
for number, line in enumerate(open(os.path.join(work, "questions.jsonl"), encoding="utf-8")):
    pair = json.loads(line)
    print(f"question {number + 1}: {pair['prompt']}\n  reference: {pair['response']}\n"
          f"  before: {before[number]}\n  after:  {after[number]}")
print(f"validation perplexity before fine-tuning: {valid_ppl(os.path.join(work, 'before.jsonl')):.2f}")
print(f"validation perplexity after fine-tuning: {valid_ppl(log):.2f}")
SUMMARY
echo "checkpoint: $CHECKPOINT_PATH (LoRA rank ${LORA_RANK:-8}; load it with the same model flags and $LORA_ARGS)"
