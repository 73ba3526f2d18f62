"""One-GPU training benchmark through the real training loop (pretrain_gpt.py, --deepspeed, ZeRO): tokens/s,
achieved TFLOP/s, MFU and peak memory against an estimate, one markdown table at the end.

    python tools/bench/bench_gpu.py                                   # GPT-2 124M and 350M, bf16, ZeRO-2 and ZeRO-3
    python tools/bench/bench_gpu.py --models 124m --stages 2 --steps 10
    python tools/bench/bench_gpu.py --plan                            # the cells and their expected time; runs nothing
    python tools/bench/bench_gpu.py --models tiny --precisions fp32 --device cpu   # the plumbing on a CPU (the tests)

Each cell (model x precision x stage) is one fresh process (`--cell`): `torch.cuda.max_memory_allocated` is its own,
an out-of-memory cell does not stop the others, and its process group (NCCL on a GPU, gloo on the CPU, as mpu
decides) rendezvous on a free port of its own and is destroyed after the row is printed. A row is printed, and
written to --json, as soon as its cell is measured: a cell that aborts in teardown, or a timeout of the whole run,
keeps the rows measured before.

A cell runs 2 x --steps iterations on mock data with --log-interval --steps and reports the second interval's
tokens/s (the first holds the warm-up). TFLOP/s = tokens/s x megatron.training.flops_per_token (the training log's
count: Narayanan et al. 2021, 3 passes of 24 L h^2 (1 + s/6h) per token, 4 with activation recomputation, plus
3 x 2 h V for the LM head); MFU = that / the GPU's dense bf16/fp16 peak, looked up by the exact name CUDA reports
(PEAK_TFLOPS; an unknown name gets no MFU rather than a guess; --peak-tflops sets it).
Memory: max_memory_allocated next to the model-state formula (megatron/guards/memory.py, the ZeRO paper's 2P + 2P +
12P at dp 1) plus activation_estimate_bytes (flash attention's, and the loss's logits with their gradient).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import write_json_rows  # noqa: E402

# GPT-2 shapes: layers, hidden, heads, sequence, vocabulary (before padding to 128), default micro-batch;
# llama-1b: scripts/pretrain_llama.sh's GPU default (TinyLlama 1.1B's shape)
MODELS = {
    "tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro=2),
    "124m": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, micro=16),
    "350m": dict(layers=24, hidden=1024, heads=16, seq=1024, vocab=50257, micro=8),
    "1.3b": dict(layers=24, hidden=2048, heads=16, seq=1024, vocab=50257, micro=4),
    "llama-1b": dict(layers=22, hidden=2048, heads=32, seq=2048, vocab=32000, micro=4,
                     llama=dict(kv_heads=4, ffn=5632)),
}
COMPILE_MODES = ("default", "eager", "compiled")   # the run's own choice, --no-torch-compile, --torch-compile
PRECISIONS = ("bf16", "fp16", "fp32")

# Dense (no sparsity) bf16/fp16 tensor-core peak in TFLOP/s by the EXACT name torch.cuda.get_device_name() reports.
# fp32 gets no MFU (its TF32 peak depends on settings). A name not here gets no MFU: a near match (an "H100" that
# is a PCIe card, an "H200" that is an NVL) would misstate it by up to 30%.
PEAK_TFLOPS = {
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 (SXM), 1,513 (PCIe), 1,671 (NVL)
    # TFLOPS "with sparsity"; dense is half.
    "NVIDIA H100 80GB HBM3": 989.5,     # H100 SXM5
    "NVIDIA H100 PCIe": 756.5,
    "NVIDIA H100 NVL": 835.5,
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 (SXM), 1,671 (NVL) with sparsity.
    "NVIDIA H200 NVL": 835.5,
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 dense (624 with sparsity), every form
    # factor and memory size.
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    # NVIDIA L4 datasheet: BF16 242 with sparsity. L40S datasheet: BF16 362.05 dense (733 with sparsity).
    # A10 datasheet: BF16 125 dense (250 with sparsity).
    "NVIDIA L4": 121.0,
    "NVIDIA L40S": 362.05,
    "NVIDIA A10": 125.0,
}
# Names CUDA gives to more than one part, told apart by the board's default power limit (nvidia-smi):
# (lowest watts, peak). "NVIDIA H200" is the H200 SXM (700 W); H200 NVL boards (600 W) are reported to carry the
# same name on some drivers (NVIDIA H200 datasheet: up to 700 W SXM, up to 600 W NVL).
SHARED_NAMES = {"NVIDIA H200": ((650.0, 989.5), (0.0, 835.5))}

# The plan's time model (--plan): guesses until a GPU run measures them, stated as such in its output.
PLAN_GPU, PLAN_PEAK = "an H200 SXM", 989.5
PLAN_STARTUP_S = 20      # per cell: interpreter, torch and CUDA start-up, NCCL group, model build, first step
PLAN_COMPILE_S = 30      # per compiled cell (default and compiled: every model compiles on CUDA): inductor, cold cache
PLAN_MFU = 0.3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="124m,350m", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--precisions", default="bf16", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    parser.add_argument("--compile", default="default",
                        help="comma-separated, of default (the run's own choice: compiled on CUDA for GPT-2 shapes), "
                             "eager (--no-torch-compile), compiled (--torch-compile); eager,compiled gives both rows")
    parser.add_argument("--steps", type=int, default=20, help="timed iterations per cell (after as many warm-up)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: per model (MODELS)")
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16/fp16 peak of this GPU (default: PEAK_TFLOPS by its exact name)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: run the same cells on the CPU (for testing the plumbing)")
    parser.add_argument("--cell-timeout", type=int, default=75, help="seconds per cell")
    parser.add_argument("--json", default=None, help="also write the rows here (rewritten after every row)")
    parser.add_argument("--plan", action="store_true", help="print the cells and their expected time; run nothing")
    parser.add_argument("--print-log", default=None, metavar="LOG",
                        help="print the table from the rows in a log of an earlier run (even a timed-out one)")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)    # MODEL,PRECISION,STAGE: one cell
    args = parser.parse_args(argv)
    args.models, args.precisions = _split(args.models), _split(args.precisions)
    args.compile = _split(args.compile)
    bad = [m for m in args.models if m not in MODELS] + [p for p in args.precisions if p not in PRECISIONS] + \
        [c for c in args.compile if c not in COMPILE_MODES]
    if bad:
        parser.error(f"unknown model/precision/compile {', '.join(bad)}: models are {', '.join(MODELS)}, precisions "
                     f"{', '.join(PRECISIONS)}, compile {', '.join(COMPILE_MODES)}")
    try:
        args.stages = [int(s) for s in _split(args.stages)]
    except ValueError:
        parser.error(f"--stages {args.stages!r}: give comma-separated integers, e.g. 2 or 2,3")
    if any(s not in (0, 1, 2, 3) for s in args.stages) or args.steps < 1:
        parser.error(f"--stages {args.stages} / --steps {args.steps}: stages are 0-3 and steps >= 1")
    return args


def _split(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def cells(args):
    return [(model, precision, stage, mode) for model in args.models for precision in args.precisions
            for stage in args.stages for mode in args.compile]


def padded_vocab(model):
    """The vocabulary the training script builds: MODELS' padded to a multiple of 128."""
    return -(-MODELS[model]["vocab"] // 128) * 128


def flops_per_token(model, checkpoint_activations=False):
    """Training FLOPs per token of `model`: the training log's own count (megatron.training.flops_per_token)."""
    from megatron.training import flops_per_token as training_flops_per_token
    m = MODELS[model]
    llama = m.get("llama")
    shape = dict(num_attention_heads=m["heads"], num_key_value_heads=llama["kv_heads"], ffn_hidden_size=llama["ffn"],
                 swiglu=True) if llama else {}
    return training_flops_per_token(m["layers"], m["hidden"], m["seq"], padded_vocab(model), checkpoint_activations,
                                    **shape)


def peak_tflops(device_name, power_limits_w=()):
    """(dense bf16/fp16 peak of the GPU called exactly `device_name`, or None; how it was found). A name shared by
    parts with different peaks is resolved by the boards' default power limits when they all agree."""
    if device_name in PEAK_TFLOPS:
        return PEAK_TFLOPS[device_name], f"datasheet peak of {device_name}"
    if device_name in SHARED_NAMES:
        limits = set(power_limits_w)
        if len(limits) == 1:
            watts = limits.pop()
            peak = next(peak for lowest, peak in SHARED_NAMES[device_name] if watts >= lowest)
            return peak, f"datasheet peak of {device_name} at a {watts:.0f} W power limit"
        return None, f"unknown peak: {device_name} names parts with different peaks and no single power limit was read"
    return None, f"unknown peak: {device_name!r} is not in bench_gpu.PEAK_TFLOPS"


def power_limits_w(device_name):
    """Default power limits (W) nvidia-smi reports for the GPUs called `device_name` (empty without nvidia-smi)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,power.default_limit", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.rpartition(",") for line in done.stdout.splitlines()]
    return [float(watts) for name, _, watts in rows if name.strip() == device_name and _is_number(watts)]


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def activation_estimate_bytes(model, micro, precision, checkpoint_activations=False, fused_loss=False):
    """Activation memory at a step's peak for our GPT-2 (Korthikanti et al. 2022, per layer, adapted):
    - a layer keeps 34 s b h bytes in 16-bit (scaled for fp32) and 4 a s b for the fp32 log-sum-exp of its
      attention. The model's attention is F.scaled_dot_product_attention, whose flash / memory-efficient kernels
      keep no s x s scores: the paper's 5 a s^2 b term is not there;
    - with --checkpoint-activations a layer keeps its input, 2 s b h, and one layer at a time is recomputed whole;
    - the eager loss (mpu/cross_entropy.py, chunked over tokens) holds at its peak, the end of its backward, the
      logits [b, s, V] it saved and their gradient, both in the training precision, plus one fp32 chunk of
      default_chunk_tokens(V, "cuda") tokens (64 MiB at most), while every layer's activations are still alive;
      the compiled loss (`fused_loss`: mpu/fused.py, a compiled run's) only the logits, its gradient written in them.
    The embeddings' and the final LayerNorm's few s b h are left out. None for a Llama shape (other constants)."""
    m = MODELS[model]
    if m.get("llama"):
        return None
    s, b, h, a = m["seq"], micro, m["hidden"], m["heads"]
    element = 4 if precision == "fp32" else 2
    full_layer = int(34 * s * b * h * element / 2) + 4 * a * s * b
    layers = m["layers"] * (2 * s * b * h * element // 2) + full_layer if checkpoint_activations \
        else m["layers"] * full_layer
    from mpu.cross_entropy import default_chunk_tokens
    vocab = padded_vocab(model)
    loss = s * b * vocab * element if fused_loss else \
        2 * s * b * vocab * element + 4 * min(s * b, default_chunk_tokens(vocab, "cuda")) * vocab
    return layers + loss


def zero_config(precision, stage, micro):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "gradient_clipping": 1.0, "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}}


def training_flags(model, precision, micro, steps, config_path, jsonl_path, checkpoint_activations,
                   compile_mode="default"):
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
    llama = m.get("llama")
    if llama:   # scripts/pretrain_llama.sh's LLAMA_ARGS
        flags += ["--swiglu", "--ffn-hidden-size", str(llama["ffn"]), "--num-key-value-heads", str(llama["kv_heads"]),
                  "--use-rotary-position-embeddings", "--no-position-embedding", "--normalization", "rmsnorm",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    flags += {"default": [], "eager": ["--no-torch-compile"], "compiled": ["--torch-compile"]}[compile_mode]
    return flags


def run_cell(model, precision, stage, args, compile_mode="default"):
    """Train one cell in this process (its process group from the environment bench_gpu's parent set); returns its
    row (dict)."""
    import torch
    import pretrain_gpt
    from megatron.guards import memory
    micro = args.micro_batch or MODELS[model]["micro"]
    with tempfile.TemporaryDirectory() as scratch:
        config_path, jsonl_path = os.path.join(scratch, "ds_config.json"), os.path.join(scratch, "log.jsonl")
        with open(config_path, "w") as handle:
            json.dump(zero_config(precision, stage, micro), handle)
        history = pretrain_gpt.main(training_flags(model, precision, micro, args.steps, config_path, jsonl_path,
                                                   args.checkpoint_activations, compile_mode))
        from megatron.global_vars import get_args
        compiled = bool(get_args().torch_compile)
        with open(jsonl_path) as handle:
            record = [json.loads(line) for line in handle][-1]
    cuda = torch.cuda.is_available()
    peak = args.peak_tflops if precision != "fp32" else None
    tflops = record["tokens_per_second"] * flops_per_token(model, args.checkpoint_activations) / 1e12
    activations = activation_estimate_bytes(model, micro, precision, args.checkpoint_activations, compiled)
    return {"model": model, "precision": precision, "stage": stage, "micro_batch": micro,
            "compile": "compiled" if compiled else "eager",
            "device": torch.cuda.get_device_name() if cuda else "cpu", "peak_tflops": peak,
            "tokens_per_s": record["tokens_per_second"], "tflops": tflops, "mfu": tflops / peak if peak else None,
            "log_tflops": record["tflops_per_rank"],
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "model_state_formula_gb": history["model_state_estimate"]["total"] / 2 ** 30,
            "activation_estimate_gb": activations / 2 ** 30 if activations is not None else None,
            "skipped": sum(history["skipped"][args.steps:]), "error": None}


def teardown():
    """Forget mpu's groups and destroy the process group (a live NCCL communicator at interpreter exit can abort
    the process)."""
    import mpu
    from megatron.initialize import shutdown
    mpu.destroy_model_parallel()
    shutdown()


def cell_environment(device):
    """The environment of one cell: a one-process group on a free port of its own (a fixed port may be another
    job's, or a previous cell's still closing); no GPU for --device cpu."""
    from megatron.spawn import free_port
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def measure_cell(cell, args):
    """Run one cell in a fresh process: its row, or a row with the error. A row printed before the process
    failed (in teardown) is kept, with the exit status in its note. A port another process took between
    free_port() and the rendezvous is retried once on a new one."""
    model, precision, stage, mode = cell
    command = [sys.executable, os.path.abspath(__file__), "--cell", f"{model},{precision},{stage},{mode}"]
    command += _cell_options(args)
    for attempt in (1, 2):
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=cell_environment(args.device),
                                  timeout=args.cell_timeout, cwd=REPO)
        except subprocess.TimeoutExpired as expired:
            row = _row_from_output(_text(expired.stdout))
            return {**row, "note": f"timed out in teardown after {args.cell_timeout} s"} if row else \
                {"model": model, "precision": precision, "stage": stage, "compile": mode,
                 "error": f"timed out after {args.cell_timeout} s"}
        row = _row_from_output(done.stdout)
        if row:
            return row if done.returncode == 0 else {**row, "note": f"exit status {done.returncode} in teardown"}
        if attempt == 1 and "EADDRINUSE" in done.stdout + done.stderr:
            continue
        return {"model": model, "precision": precision, "stage": stage, "compile": mode,
                "error": _last_error(done.stdout + done.stderr)}


def _cell_options(args):
    """The options a cell process needs from this one's (the peak resolved here, once)."""
    options = ["--steps", str(args.steps)]
    options += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
    options += ["--checkpoint-activations"] if args.checkpoint_activations else []
    return options + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _row_from_output(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("BENCH_GPU_ROW ")]
    return json.loads(lines[-1][len("BENCH_GPU_ROW "):]) if lines else None


def _last_error(output):
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:160]


HEADER = ("| model | precision | ZeRO | compile | micro-batch | tokens/s | TFLOP/s | MFU | max allocated GB | "
          "model-state formula GB | + activation estimate GB | note |")
RULE = "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"


def _number(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_row(row):
    if row.get("error"):
        return (f"| {row['model']} | {row['precision']} | {row['stage']} | {row.get('compile', '')} | | | | | | | | "
                f"failed: {row['error']} |")
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    notes = [f"{row['skipped']} skipped (fp16 overflow)"] if row.get("skipped") else []
    notes += [row["note"]] if row.get("note") else []
    estimate = None if row["activation_estimate_gb"] is None else \
        row["model_state_formula_gb"] + row["activation_estimate_gb"]
    return (f"| {row['model']} | {row['precision']} | {row['stage']} | {row.get('compile', '')} | "
            f"{row['micro_batch']} | "
            f"{_number(row['tokens_per_s'], ',.0f')} | {_number(row['tflops'], '.1f')} | {mfu} | "
            f"{_number(row['max_allocated_gb'], '.2f')} | {_number(row['model_state_formula_gb'], '.2f')} | "
            f"{_number(estimate, '.2f')} | {'; '.join(notes)} |")


def device_line(device_name, peak, how):
    peak_text = f"peak {peak:g} TFLOP/s dense bf16/fp16 ({how})" if peak else f"{how}: no MFU (--peak-tflops sets it)"
    return f"# device: {device_name}; {peak_text}"


def format_table(rows, device_header=None):
    return "\n".join(([device_header] if device_header else []) + [HEADER, RULE] + [format_row(row) for row in rows])


def table_from_log(text):
    """The table from the row lines of a bench_gpu log (each row once, in order; header and rule lines dropped;
    the device line kept)."""
    head = next(([line] for line in text.splitlines() if line.startswith("# device: ")), [])
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and line != HEADER and line not in rows:
            rows.append(line)
    return "\n".join(head + [HEADER, RULE] + rows) if rows else "(no benchmark rows in the log)"


def plan(args):
    """The cells, each with its expected seconds, and their sum (a time model with stated guesses: no GPU run has
    measured it)."""
    lines, total = [], 0.0
    for model, precision, stage, mode in cells(args):
        m = MODELS[model]
        micro = args.micro_batch or m["micro"]
        compute = 2 * args.steps * micro * m["seq"] * flops_per_token(model, args.checkpoint_activations) \
            / (PLAN_MFU * PLAN_PEAK * 1e12)
        cell_s = PLAN_STARTUP_S + (PLAN_COMPILE_S if mode != "eager" else 0) + compute
        total += cell_s
        label = "" if mode == "default" else f" {mode}"
        lines.append(f"    {model} {precision} ZeRO-{stage}{label}: micro-batch {micro} x {m['seq']} tokens, "
                     f"{2 * args.steps} steps, ~{cell_s:.0f} s")
    lines.append(f"    (guesses, not measurements: {PLAN_STARTUP_S} s of start-up per cell, {PLAN_COMPILE_S} s of "
                 f"compile per compiled cell, the steps at "
                 f"{PLAN_MFU:.0%} MFU of {PLAN_GPU}'s {PLAN_PEAK:g} TFLOP/s; stage 3 may take longer)")
    count = len(cells(args))
    lines.append(f"expected: ~{total:.0f} s for {count} cell{'s' * (count != 1)} (at most {args.cell_timeout} s each)")
    return "\n".join(lines)


def device_and_peak(args):
    """(device name, dense peak TFLOP/s or None, how the peak was found); None for the name when CUDA is absent."""
    if args.device == "cpu":
        return "cpu", None, "a CPU has no tensor-core peak"
    import torch
    if not torch.cuda.is_available():
        return None, None, None
    name = torch.cuda.get_device_name()
    if args.peak_tflops:
        return name, args.peak_tflops, "--peak-tflops"
    peak, how = peak_tflops(name, power_limits_w(name) if name in SHARED_NAMES else ())
    return name, peak, how


def main(argv=None):
    args = parse_args(argv)
    if args.print_log:
        with open(args.print_log) as handle:
            print(table_from_log(handle.read()))
        return 0
    if args.plan:
        print(plan(args))
        return 0
    if args.cell:
        model, precision, stage, mode = args.cell.split(",")
        print("BENCH_GPU_ROW " + json.dumps(run_cell(model, precision, int(stage), args, mode)), flush=True)
        teardown()
        return 0
    device_name, args.peak_tflops, how = device_and_peak(args)
    if device_name is None:
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False): run on a GPU machine, or pass "
              "--device cpu to exercise the plumbing", file=sys.stderr)
        return 1
    header = device_line(device_name, args.peak_tflops, how)
    print(header + "\n" + HEADER + "\n" + RULE, flush=True)
    rows = []
    for cell in cells(args):
        rows.append(measure_cell(cell, args))
        print(format_row(rows[-1]), flush=True)
        if args.json:
            write_json_rows(args.json, rows)
    print("\n" + format_table(rows, header))
    return 0 if all(not row.get("error") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
