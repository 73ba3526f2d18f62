#!/usr/bin/env bash
# Greedy and nucleus-sampled (top-p) continuations of a prompt by a trained checkpoint, with the launch scripts'
# model flags and tokenizer.
#
#   bash scripts/generate_text.sh                                   # "Return the number of" from checkpoints/gpt2_zero2
#   PROMPT="import numpy as np" CHECKPOINT_PATH=checkpoints/gpt2 OUT_SEQ_LENGTH=48 bash scripts/generate_text.sh
#
# Reads: PYTHON, PROMPT, CHECKPOINT_PATH, OUT_SEQ_LENGTH, TOP_P (default 0.9), SEED (default 1234), the model shape
# and VOCAB_FILE/MERGE_FILE as the launch scripts do (see scripts/_common.sh), EXTRA_ARGS (appended to both
# generations' flags: e.g. the checkpoint's other model flags, --num-experts 4). Either path's checkpoint, any
# model-parallel size (loaded weights-only).
source "$(dirname "$0")/_common.sh"
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_zero2}
PROMPT=${PROMPT:-Return the number of}
TOP_P=${TOP_P:-0.9}
SEED=${SEED:-1234}
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
printf '%s\n' "$PROMPT" > "$workdir/prompt.txt"
GEN_ARGS="$MODEL_ARGS --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --load $CHECKPOINT_PATH \
  --sample-input-file $workdir/prompt.txt --out-seq-length ${OUT_SEQ_LENGTH:-32}"
launch 1 tools/generate_samples_gpt.py $GEN_ARGS --greedy --sample-output-file "$workdir/greedy.txt" \
  ${EXTRA_ARGS:-} > "$workdir/log.txt" 2>&1 || { cat "$workdir/log.txt"; exit 1; }
launch 1 tools/generate_samples_gpt.py $GEN_ARGS --top_p "$TOP_P" --seed "$SEED" \
  --sample-output-file "$workdir/top_p.txt" ${EXTRA_ARGS:-} > "$workdir/log.txt" 2>&1 || { cat "$workdir/log.txt"; exit 1; }
echo "greedy continuation ($CHECKPOINT_PATH):"
cat -s "$workdir/greedy.txt"   # (blank lines squeezed)
echo "sampled continuation (top-p $TOP_P, seed $SEED):"
cat -s "$workdir/top_p.txt"
