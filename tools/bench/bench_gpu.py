"""One-GPU training benchmark through the real training loop (pretrain_gpt.py, --deepspeed, ZeRO): tokens/s,
achieved TFLOP/s, MFU and peak memory against the ZeRO formula, one markdown table at the end.

    python tools/bench/bench_gpu.py                                   # GPT-2 124M and 1.3B, bf16 and fp16, ZeRO-2
    python tools/bench/bench_gpu.py --models 124m --precisions bf16 --stages 2 --steps 10
    python tools/bench/bench_gpu.py --models tiny --device cpu        # the plumbing on a CPU (what the tests run)

Each cell (model x precision x stage) is one fresh process (`--cell`), so `torch.cuda.max_memory_allocated` is its
own and an out-of-memory cell does not stop the others. A cell runs 2 x --steps iterations on mock data with
--log-interval --steps and reports the second interval's tokens/s (the first holds the warm-up). TFLOP/s =
tokens/s x `flops_per_token` (Narayanan et al. 2021, eq. 3: 24 L h^2 (1 + s/6h) FLOPs per token and pass, 3 passes,
4 with activation recomputation, plus 6 h V for the LM head); MFU = that / the GPU's dense peak for the precision
(PEAK_TFLOPS, datasheet figures without sparsity; --peak-tflops overrides). The training log's own "TFLOP/s per
rank" (megatron/training.py `_flops_per_iteration`) is recorded too, as `log_tflops`.
Memory: max_memory_allocated next to the model-state formula (megatron/guards/memory.py, the ZeRO paper's 2P + 2P + 12P
at dp 1) plus the activation estimate (Korthikanti et al. 2022) for the micro-batch.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

# GPT-2 shapes: layers, hidden, heads, sequence, vocabulary (before padding), default micro-batch
MODELS = {
    "tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro=2),
    "124m": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, micro=8),
    "1.3b": dict(layers=24, hidden=2048, heads=16, seq=1024, vocab=50257, micro=4),
}
PRECISIONS = ("bf16", "fp16", "fp32")
# Dense tensor-core peak TFLOP/s for bf16/fp16 by device-name substring (first match wins), from the vendors'
# datasheets; fp32 MFU is left out (TF32 peaks differ by setting).
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
               ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.0), ("V100", 125.0))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="124m,1.3b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--precisions", default="bf16,fp16", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--stages", default="auto",
                        help="comma-separated ZeRO stages; auto: 2, and 3 where the engine accepts it")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per cell (after as many warm-up)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: per model (MODELS)")
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense peak of this GPU (default: table)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: run the same cells on the CPU (for testing the plumbing)")
    parser.add_argument("--cell-timeout", type=int, default=240, help="seconds per cell")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--print-log", default=None, metavar="LOG",
                        help="print the table from the rows in a log of an earlier run (even a timed-out one)")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)    # MODEL,PRECISION,STAGE: one cell
    args = parser.parse_args(argv)
    args.models, args.precisions = _split(args.models), _split(args.precisions)
    bad = [m for m in args.models if m not in MODELS] + [p for p in args.precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"unknown model/precision {', '.join(bad)}: models are {', '.join(MODELS)}, precisions "
                     f"{', '.join(PRECISIONS)}")
    try:
        args.stages = default_stages() if args.stages == "auto" else [int(s) for s in _split(args.stages)]
    except ValueError:
        parser.error(f"--stages {args.stages!r}: give comma-separated integers, e.g. 2 or 2,3")
    if any(s not in (0, 1, 2, 3) for s in args.stages) or args.steps < 1:
        parser.error(f"--stages {args.stages} / --steps {args.steps}: stages are 0-3 and steps >= 1")
    return args


def _split(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def default_stages():
    """[2], plus 3 when the engine's config accepts stage 3."""
    from megatron import zero
    try:
        zero.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, 1)
        return [2, 3]
    except zero.ConfigError:
        return [2]


def flops_per_token(model, checkpoint_activations=False, vocab=None):
    """Training FLOPs per token (Narayanan et al. 2021, eq. 3): each transformer pass costs 24 L h^2 (1 + s/6h)
    (the four h x h-sized matmuls per layer, 24 h^2, and attention scores and values, 4 s h), forward + backward
    = 3 passes (4 when recomputing activations); the LM head 2 h V per pass, 3 passes. `vocab`: the padded
    vocabulary (default: MODELS' vocabulary padded to a multiple of 128, as the training script does)."""
    from megatron.training import flops_per_token as training_flops_per_token   # the training log's count
    m = MODELS[model]
    vocab = vocab or -(-m["vocab"] // 128) * 128
    return training_flops_per_token(m["layers"], m["hidden"], m["seq"], vocab, checkpoint_activations)


def peak_tflops(device_name, override=None):
    """Dense bf16/fp16 peak of the named GPU (None when unknown: MFU is then not reported)."""
    if override:
        return override
    return next((peak for name, peak in PEAK_TFLOPS if name in (device_name or "")), None)


def zero_config(precision, stage, micro):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "gradient_clipping": 1.0, "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}}


def training_flags(model, precision, micro, steps, config_path, jsonl_path, checkpoint_activations):
    m = MODELS[model]
    flags = ["--mock-data", "--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
             "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]), "--vocab-size", str(m["vocab"]),
             "--batch-size", str(micro), "--train-iters", str(2 * steps), "--log-interval", str(steps),
             "--eval-iters", "0", "--lr", "1e-4", "--warmup", "0", "--seed", "1234",
             "--deepspeed", "--deepspeed_config", config_path, "--log-jsonl", jsonl_path]
    if precision != "fp32":
        flags.append(f"--{precision}")
    if checkpoint_activations:
        flags.append("--checkpoint-activations")
    return flags


def run_cell(model, precision, stage, args):
    """Train one cell in this process; returns its row (dict)."""
    import torch
    import pretrain_gpt
    from megatron.guards import memory
    m, micro = MODELS[model], args.micro_batch or MODELS[model]["micro"]
    with tempfile.TemporaryDirectory() as scratch:
        config_path, jsonl_path = os.path.join(scratch, "ds_config.json"), os.path.join(scratch, "log.jsonl")
        with open(config_path, "w") as handle:
            json.dump(zero_config(precision, stage, micro), handle)
        history = pretrain_gpt.main(training_flags(model, precision, micro, args.steps, config_path, jsonl_path,
                                                   args.checkpoint_activations))
        with open(jsonl_path) as handle:
            record = [json.loads(line) for line in handle][-1]
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(name, args.peak_tflops) if precision != "fp32" else None
    tflops = record["tokens_per_second"] * flops_per_token(model, args.checkpoint_activations) / 1e12
    activations = memory.activation_bytes(m["layers"], m["seq"], micro, m["hidden"], m["heads"],
                                          checkpoint_activations=args.checkpoint_activations,
                                          bytes_per_element=4 if precision == "fp32" else 2)
    return {"model": model, "precision": precision, "stage": stage, "micro_batch": micro, "device": name,
            "tokens_per_s": record["tokens_per_second"], "tflops": tflops, "mfu": tflops / peak if peak else None,
            "log_tflops": record["tflops_per_rank"],
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "model_state_formula_gb": history["model_state_estimate"]["total"] / 2 ** 30,
            "activation_estimate_gb": activations / 2 ** 30,
            "skipped": sum(history["skipped"][args.steps:]), "error": None}


def run_cells(args):
    """Every cell in its own process (fresh memory counters; a failure becomes a row with its error)."""
    rows = []
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if args.device == "cpu" else dict(os.environ)
    passthrough = ["--steps", str(args.steps)] + (["--micro-batch", str(args.micro_batch)] if args.micro_batch else []) \
        + (["--checkpoint-activations"] if args.checkpoint_activations else []) \
        + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
    for model in args.models:
        for precision in args.precisions:
            for stage in args.stages:
                cell = f"{model},{precision},{stage}"
                try:
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--cell", cell] + passthrough,
                                          capture_output=True, text=True, env=env, timeout=args.cell_timeout,
                                          cwd=REPO)
                    row = _row_from_output(done.stdout) if done.returncode == 0 else None
                    error = None if row else _last_error(done.stdout + done.stderr)
                except subprocess.TimeoutExpired:
                    row, error = None, f"timed out after {args.cell_timeout} s"
                rows.append(row or {"model": model, "precision": precision, "stage": stage, "error": error})
                print(format_row(rows[-1]), flush=True)
    return rows


def _row_from_output(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("BENCH_GPU_ROW ")]
    return json.loads(lines[-1][len("BENCH_GPU_ROW "):]) if lines else None


def _last_error(output):
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:160]


HEADER = ("| model | precision | ZeRO | micro-batch | tokens/s | TFLOP/s | MFU | max allocated GB | "
          "model-state formula GB | + activation estimate GB | note |")
RULE = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"


def _number(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_row(row):
    if row.get("error"):
        return f"| {row['model']} | {row['precision']} | {row['stage']} | | | | | | | | failed: {row['error']} |"
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    note = f"{row['skipped']} skipped (fp16 overflow)" if row.get("skipped") else ""
    return (f"| {row['model']} | {row['precision']} | {row['stage']} | {row['micro_batch']} | "
            f"{_number(row['tokens_per_s'], ',.0f')} | {_number(row['tflops'], '.1f')} | {mfu} | "
            f"{_number(row['max_allocated_gb'], '.2f')} | {_number(row['model_state_formula_gb'], '.2f')} | "
            f"{_number(row['model_state_formula_gb'] + row['activation_estimate_gb'], '.2f')} | {note} |")


def format_table(rows, device_name=None):
    lines = [f"# device: {device_name}"] if device_name else []
    return "\n".join(lines + [HEADER, RULE] + [format_row(row) for row in rows])


def table_from_log(text):
    """The table from the row lines of a bench_gpu log (each row once, in order; header and rule lines dropped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and line != HEADER and line not in rows:
            rows.append(line)
    return "\n".join([HEADER, RULE] + rows) if rows else "(no benchmark rows in the log)"


def main(argv=None):
    args = parse_args(argv)
    if args.print_log:
        with open(args.print_log) as handle:
            print(table_from_log(handle.read()))
        return 0
    if args.cell:
        model, precision, stage = args.cell.split(",")
        print("BENCH_GPU_ROW " + json.dumps(run_cell(model, precision, int(stage), args)), flush=True)
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device (torch.cuda.is_available() is False): run on a GPU machine, or pass "
                  "--device cpu to exercise the plumbing", file=sys.stderr)
            return 1
        device_name = torch.cuda.get_device_name()
    else:
        device_name = "cpu"
    print(HEADER + "\n" + RULE, flush=True)
    rows = run_cells(args)
    print("\n" + format_table(rows, device_name))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if all(not row.get("error") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
