"""Supervised fine-tuning throughput on the embedded SFT data (data/sft, tools/prepare_sft_data.py): full
fine-tuning vs LoRA, padded vs packed micro-batches, in the `make finetune` setting (the CPU default shape
L2 h128 s128, scripts/ds_zero2_config.json's micro-batch (32), ZeRO-2, fp32; fresh weights: the speed does not
depend on them).

    python tools/bench/bench_sft.py [--iters 30] [--repeats 2]

Each row is a fresh process (finetune_gpt.py's main) per repeat; the two ways of each comparison alternate which
runs first. Columns:
    s/step              median seconds of an optimizer step (train_step), the first 3 of each run skipped
    examples/step       examples in a global batch (packed rows hold several)
    vs padded           response tokens/s relative to the padded row (each micro-batch padded to its longest
                        example, as finetune_gpt.py does); "padded to seq-length" pads every row to 128 tokens
                        (DeepSpeed-Chat's way), measured for reference
    response tokens/s   the loss-mask tokens of the global batch / the step's time
    model state MB      parameters, gradients and optimizer state per rank, as the training loop measures them
A second table: the step time of the reward model and of DPO (4 pairs per step, the default preference data)
relative to an SFT step (4 examples): the reward model and DPO score 8 rows a step, DPO also runs its reference.
Targets: packed >= 1.5x padded response tokens/s (the answers here are short); LoRA's model state well below
full fine-tuning's (no gradients or optimizer state for the frozen weights). Measured on 2 cores: see
docs/benchmarks.md (at micro-batch 32 packing is 2.7x; at micro-batch 4 our per-micro-batch padding left
little to win and packing was 0.95-1.16x).
"""
import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SKIPPED_STEPS = 3
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128"]
LORA = ["--lora-rank", "8", "--lora-alpha", "16"]


def base_checkpoint(directory):
    """A checkpoint of the default shape to fine-tune from: one iteration of pretraining on the default data."""
    import contextlib
    import io
    import pretrain_gpt
    flags = MODEL + ["--data-path", os.path.join(REPO, "data", "webtext", "webtext_text_document"),
                     "--vocab-file", os.path.join(REPO, "data", "webtext", "vocab.json"),
                     "--merge-file", os.path.join(REPO, "data", "webtext", "merges.txt"), "--split", "949,50,1",
                     "--batch-size", "4", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0",
                     "--save", directory, "--save-interval", "1"]
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain_gpt.main(flags)


def sft_flags(iters, base):
    import json
    manifest = json.load(open(os.path.join(REPO, "data", "sft", "chatterbot.json")))
    return MODEL + ["--load", base, "--data-path", os.path.join(REPO, "data", "sft", "chatterbot"),
            "--split", manifest["split"], "--vocab-file", os.path.join(REPO, "data", "webtext", "vocab.json"),
            "--merge-file", os.path.join(REPO, "data", "webtext", "merges.txt"), "--train-iters", str(iters),
            "--lr", "1e-3", "--log-interval", str(iters + 1), "--eval-interval", str(iters + 1), "--eval-iters", "0",
            "--deepspeed", "--deepspeed_config", os.path.join(REPO, "scripts", "ds_zero2_config.json")]


NO_TRIM = "--bench-pad-to-seq-length"   # this bench's own flag: pad every row to --seq-length (DeepSpeed-Chat)


def _run(flags, script="finetune_gpt"):
    """One run of `script`'s main in this process: (step seconds, response tokens per step, examples per step,
    model state bytes); the token and example counts are the SFT batches' (0 for the other objectives)."""
    import contextlib
    import importlib
    import io
    entry = importlib.import_module(script)
    import megatron.training as training
    from megatron.posttrain.sft_loss import StepBatches
    step_times, tokens, examples = [], [], []
    real_step, real_next = training.train_step, StepBatches.next

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        result = real_step(*args, **kwargs)
        step_times.append(time.perf_counter() - start)
        return result

    def counted_next(self, *args, **kwargs):     # one micro-batch (no validation runs: --eval-iters 0)
        rows, step_tokens = real_next(self, *args, **kwargs)
        tokens.append(float(rows["loss_mask"][:, 1:].sum()))
        examples.append(sum(len(set(row.tolist()) - {0}) for row in rows["segments"]))
        return rows, step_tokens
    training.train_step, StepBatches.next = timed_step, counted_next
    import megatron.posttrain.sft_loss as sft_loss    # SFT trims its host rows there (StepBatches)
    real_trim = sft_loss.trim_to_longest
    if NO_TRIM in flags:
        flags = [flag for flag in flags if flag != NO_TRIM]
        sft_loss.trim_to_longest = lambda rows: rows
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            history = entry.main(flags)
    finally:
        training.train_step, StepBatches.next, sft_loss.trim_to_longest = real_step, real_next, real_trim
    steps = len(step_times)
    return step_times, [sum(tokens) / steps], [sum(examples) / steps], history.get("model_state_measured")


def bench_objectives(iters, repeats, base):
    """Step seconds of SFT (4 examples per step), the reward model and DPO (4 pairs per step: 8 rows, and DPO's
    reference forward) on the default data, full fine-tuning, padded; the order alternates between repeats."""
    import json
    from megatron.spawn import run_distributed
    manifest = json.load(open(os.path.join(REPO, "data", "sft", "chatterbot.json")))["preference"]
    pairs = ["--data-path", os.path.join(REPO, "data", "sft", manifest["data_prefix"]), "--split", manifest["split"]]

    def with_pairs(flags):
        flags = list(flags)
        at = flags.index("--data-path")
        flags[at:at + 4] = pairs
        return flags
    configs = {"SFT": ("finetune_gpt", []), "reward model": ("train_reward_model", None),
               "DPO": ("finetune_gpt", ["--objective", "dpo"])}
    times = {name: [] for name in configs}
    for repeat in range(repeats):
        for name in (list(configs) if repeat % 2 == 0 else list(reversed(configs))):
            script, extra = configs[name]
            flags = sft_flags(iters, base) if name == "SFT" else with_pairs(sft_flags(iters, base)) + (extra or [])
            runs = run_distributed(_run, 1, args=(flags, script), model_parallel_size=1, timeout=1800)
            times[name] += runs[0][0][SKIPPED_STEPS:]
    return {name: statistics.median(values) for name, values in times.items()}


def print_objectives_table(seconds):
    columns = ["objective", "s/step", "vs SFT"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for name, value in seconds.items():
        cells = [name, f"{value:.4f}", f"{value / seconds['SFT']:.2f}x"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def bench(iters, repeats, base):
    from megatron.spawn import run_distributed
    configs = {"full, padded": [], "full, packed": ["--pack-sequences"],
               "full, padded to seq-length": [NO_TRIM], "LoRA, padded": LORA,
               "LoRA, packed": LORA + ["--pack-sequences"]}
    results = {name: [] for name in configs}
    for repeat in range(repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
        for name in order:
            results[name].append(run_distributed(_run, 1, args=(sft_flags(iters, base) + configs[name],),
                                                 model_parallel_size=1, timeout=1800)[0])
    rows = {}
    for name, runs in results.items():
        seconds = statistics.median(t for times, _, _, _ in runs for t in times[SKIPPED_STEPS:])
        tokens = statistics.mean(t for _, counts, _, _ in runs for t in counts)
        examples = statistics.mean(e for _, _, counts, _ in runs for e in counts)
        rows[name] = {"seconds": seconds, "tokens/s": tokens / seconds, "examples": examples,
                      "model state MB": runs[0][3]["total"] / 1e6}
    return rows


def print_table(rows):
    columns = ["run", "s/step", "examples/step", "response tokens/s", "vs padded", "model state MB"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for name, row in rows.items():
        padded = rows[name.split(",")[0] + ", padded"]["tokens/s"]
        cells = [name, f"{row['seconds']:.4f}", f"{row['examples']:.1f}", f"{row['tokens/s']:.0f}",
                 f"{row['tokens/s'] / padded:.2f}x", f"{row['model state MB']:.2f}"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    if not os.path.isfile(os.path.join(REPO, "data", "sft", "chatterbot.json")):
        sys.exit("error: data/sft is missing: run python tools/prepare_sft_data.py (or make finetune) first")
    import shutil
    import tempfile
    from megatron.spawn import run_distributed
    base = tempfile.mkdtemp()
    try:
        run_distributed(base_checkpoint, 1, args=(base,), model_parallel_size=1, timeout=600)
        print_table(bench(options.iters, options.repeats, base))
        print_objectives_table(bench_objectives(options.iters, options.repeats, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
