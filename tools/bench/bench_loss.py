"""The vocab-parallel loss alone (mpu/cross_entropy.py, model-parallel 1): forward + backward time and peak memory
of our chunked loss next to torch's `F.cross_entropy` on the logits upcast to fp32 (the plain PyTorch way, and
what the loss did before it was chunked: fp32 copies of the whole logits).

    python tools/bench/bench_loss.py                                   # 8 x 256 tokens, vocab 8192, fp32 and bf16
    python tools/bench/bench_loss.py --tokens 16384 --vocab 50304 --dtypes bf16 --chunk-tokens 333 64

Each (implementation, dtype) cell runs in its own short subprocess, cells alternating, for `--rounds` rounds: time is
the median of the per-round medians of `--steps` forward + backward passes, the ratio the median of per-round ratios
against torch (same round, so the shared machine's slow phases cancel). Peak memory is the process's peak resident
memory (VmHWM) after the loss minus before it, with the logits already allocated and touched: what the loss adds,
the gradient of the logits included. Runs on mpu's device; on CUDA the peak is max_memory_allocated's increase.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cell(impl, dtype_name, tokens, vocab, steps, chunk_tokens, threads):
    """One cell in this process: {'times': [s per forward + backward], 'peak_mb': what the loss added}."""
    import torch
    import torch.nn.functional as F
    import mpu
    from bench_common import init_single_process, peak_rss_mb
    if threads:
        torch.set_num_threads(threads)
    init_single_process()
    device = mpu.get_device()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=dtype, device=device).mul_(2).requires_grad_()   # no fp32 temporary
    target = torch.randint(0, vocab, (tokens,), device=device)

    def step():
        if impl == "torch":
            loss = F.cross_entropy(logits.float(), target)
        else:
            loss = mpu.vocab_parallel_cross_entropy(logits, target, chunk_tokens=chunk_tokens).mean()
        loss.backward()
        logits.grad = None

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = peak_rss_mb()
    step()
    synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20 if device.type == "cuda" else peak_rss_mb() - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return {"times": times, "peak_mb": peak}


def _run_cell(impl, dtype, args, chunk_tokens):
    command = [sys.executable, os.path.abspath(__file__), "--cell", impl, dtype, str(args.tokens), str(args.vocab),
               str(args.steps), str(chunk_tokens or 0), str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} {dtype} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8 * 256, help="tokens (rows of the logits)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (columns of the logits)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--chunk-tokens", nargs="+", type=int, default=[0, 64],
                        help="chunk sizes of ours to measure (0: the default for vocab and device)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=5, help="forward + backward passes per cell per round")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per cell (0: torch's default). On a loaded shared CPU 2 threads make "
                             "every small op wait for a descheduled thread: compare at 1 too")
    parser.add_argument("--cell", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        impl, dtype, tokens, vocab, steps, chunk, threads = args.cell
        print(json.dumps(_cell(impl, dtype, int(tokens), int(vocab), int(steps), int(chunk) or None, int(threads))))
        return

    import torch
    import mpu
    from mpu.cross_entropy import default_chunk_tokens
    default = default_chunk_tokens(args.vocab, mpu.get_device().type)
    impls = [("torch", None)] + [(f"ours, chunk {c or default}" + ("" if c else " (default)"), c)
                                 for c in args.chunk_tokens]
    print(f"# loss forward + backward, {args.tokens} tokens x vocab {args.vocab}, {args.rounds} rounds x "
          f"{args.steps} steps, {args.threads or torch.get_num_threads()} thread(s), {torch.__version__}")
    print("| dtype | implementation | ms (median, min-max) | vs torch | peak added MB |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes:
        rows = {name: {"ms": [], "peak": []} for name, _ in impls}
        ratios = {name: [] for name, _ in impls}
        for _ in range(args.rounds):
            this_round = {}
            for name, chunk in impls:
                cell = _run_cell("torch" if name == "torch" else "ours", dtype, args, chunk)
                this_round[name] = statistics.median(cell["times"]) * 1e3
                rows[name]["ms"].append(this_round[name])
                rows[name]["peak"].append(cell["peak_mb"])
            for name in this_round:
                ratios[name].append(this_round["torch"] / this_round[name])
        for name, _ in impls:
            ms = rows[name]["ms"]
            print(f"| {dtype} | {name} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
                  f"{statistics.median(ratios[name]):.2f}x | {statistics.median(rows[name]['peak']):.0f} |")


if __name__ == "__main__":
    main()
