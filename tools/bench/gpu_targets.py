"""Issue 54's GPU targets, each marked met, missed or not measured, from the rows the benchmarks wrote:
bench_gpu.py --json (training) and bench_generate.py --json (generation against HF generate).

    python tools/bench/gpu_targets.py --training runs/gpu_check/bench_gpu.json --generation runs/gpu_check/generate.json

A target takes the best row that measures it (any compile mode, micro-batch or stage); ZeRO-3 at data-parallel 1
takes the worst ZeRO-3 / ZeRO-2 tokens/s ratio over the pairs measured alike (model, precision, compile, micro-batch).
Rows with an error, and generation rows not on CUDA, measure nothing. Exit status 0 either way: the table is the
result (tools/gpu_check.sh appends it to its summary).
"""
import argparse
import json
import os
import sys

# (what, model, minimum): training throughput targets on one GPU in bf16
TRAINING = [("GPT-2 124M tokens/s", "124m", "tokens_per_s", 470_000),
            ("GPT-2 350M MFU", "350m", "mfu", 0.40),
            ("GPT-2 1.3B MFU", "1.3b", "mfu", 0.50),
            ("Llama 1B MFU", "llama-1b", "mfu", 0.45)]
ZERO3_WITHIN = 0.97                                          # ZeRO-3 tokens/s at least 97% of ZeRO-2's at dp 1
GENERATION = [(1, 3.0), (8, 2.0), (32, 2.0)]                 # (batch, minimum ours / HF generate), GPT-2 124M bf16


def _load(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as handle:
        return json.load(handle)


def _fmt(value, key):
    return f"{100 * value:.1f}%" if key == "mfu" else f"{value:,.0f}" if key == "tokens_per_s" else f"{value:.2f}x"


def _row(what, target, best, key, minimum, how):
    if best is None:
        return f"| {what} | {target} | not measured | - | {how} |"
    verdict = "met" if best >= minimum else "missed"
    return f"| {what} | {target} | {_fmt(best, key)} | {verdict} | |"


def training_lines(rows):
    good = [r for r in rows if not r.get("error") and r.get("precision") == "bf16"]
    lines = []
    for what, model, key, minimum in TRAINING:
        values = [r[key] for r in good if r["model"] == model and r.get(key) is not None]
        target = f">= {_fmt(minimum, key)}"
        lines.append(_row(what, target, max(values) if values else None, key, minimum,
                          f"bench_gpu.py --models {model}"))
    pairs = {}
    for r in good:
        pairs.setdefault((r["model"], r.get("compile"), r["micro_batch"]), {})[r["stage"]] = r["tokens_per_s"]
    ratios = [stages[3] / stages[2] for stages in pairs.values() if 2 in stages and 3 in stages]
    lines.append(_row("ZeRO-3 / ZeRO-2 tokens/s at dp 1 (worst pair)", f">= {ZERO3_WITHIN:.2f}x",
                      min(ratios) if ratios else None, "ratio", ZERO3_WITHIN, "bench_gpu.py --stages 2,3"))
    return lines


def generation_lines(rows):
    lines = []
    for batch, minimum in GENERATION:
        values = [r["ours_over_hf"] for r in rows if r.get("device") == "cuda" and r["batch"] == batch]
        lines.append(_row(f"generation batch {batch}, ours / HF generate", f">= {minimum:.2f}x",
                          max(values) if values else None, "ratio", minimum,
                          f"bench_generate.py --device cuda --batches {batch}"))
    return lines


def targets_table(training_rows, generation_rows):
    return "\n".join(["| target | wanted | measured | verdict | to measure |", "|---|---|---:|---|---|"]
                     + training_lines(training_rows) + generation_lines(generation_rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training", default=None, help="bench_gpu.py's --json file")
    parser.add_argument("--generation", default=None, help="bench_generate.py's --json file")
    args = parser.parse_args(argv)
    print(targets_table(_load(args.training), _load(args.generation)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
