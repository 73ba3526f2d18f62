"""Benchmark context parallelism (--context-parallel-size): tokens/s and memory per rank at C = 1, 2, 4 for one
sequence whose activations do not fit one rank's activation budget at C = 1.

    python tools/bench/bench_context_parallel.py                           # L=2 h=128 s=8192, budget 96 MiB
    python tools/bench/bench_context_parallel.py --seq-length 16384 --budget-mib 128 --sizes 1 2 4

For each C, C fresh processes (megatron.spawn: gloo on the CPU, one GPU per rank on CUDA) build the GPT-2 layers
(mpu.ParallelTransformer, fp32, dropout 0) and run, on each rank's 2 chunks of one sequence ([1, s/C, h]), one
warm-up step, one forward whose saved tensors are counted (torch.autograd.graph.saved_tensors_hooks: the
activation bytes this rank keeps for backward, parameters excluded, next to memory.activation_bytes_saved's
estimate), then `--steps` timed forward+backward steps. C = 1 runs the plain layers (SDPA's causal kernel); C > 1
ring attention (mpu/context_parallel.py). Columns:

    activations   bytes autograd keeps per rank (measured) and the estimate, MiB; "fits" against --budget-mib
    peak          the largest resident set of the ranks minus its size after the warm-up step, MiB (CPU, glibc's
                  mmap threshold fixed at 1 MiB so freed blocks leave the resident set), or
                  torch.cuda.max_memory_allocated (CUDA): activations plus the transient attention blocks
    tokens/s      the whole sequence's tokens per second of forward+backward (median of the steps)

On a CPU with fewer cores than ranks the ranks share cores: tokens/s then measures memory relief, not speed-up.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import peak_rss_mb  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes C")
    parser.add_argument("--budget-mib", type=float, default=96.0,
                        help="one rank's activation budget: the sequence must not fit it at C = 1")
    parser.add_argument("--steps", type=int, default=3)
    return parser.parse_args(argv)


def _current_rss_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rank(options):
    """One rank: (saved activation bytes, peak memory growth MiB, step seconds)."""
    import torch
    import mpu
    cp = options["cp"]
    mpu.initialize_model_parallel(1, context_parallel_size=cp)
    mpu.model_parallel_cuda_manual_seed(1234)
    device = mpu.get_device()
    stack = mpu.ParallelTransformer(options["layers"], options["hidden"], options["heads"], 0.0, 0.0,
                                    final_layernorm=False)
    x = torch.randn(1, options["seq"] // cp, options["hidden"], device=device)      # [1, s/C, h]: this rank's

    def step():
        stack(x.clone().requires_grad_()).sum().backward()
    step()                                                    # warm-up: allocator and kernels settle
    built = _current_rss_mb()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    from megatron.guards.memory import saved_activation_bytes
    saved = saved_activation_bytes(stack, x)
    times = []
    for _ in range(options["steps"]):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else peak_rss_mb() - built
    return saved, peak, times


def measure(args, cp):
    from megatron.spawn import run_distributed
    options = {"cp": cp, "layers": args.num_layers, "hidden": args.hidden_size, "heads": args.num_attention_heads,
               "seq": args.seq_length, "steps": args.steps}
    results = run_distributed(_rank, cp, args=(options,))
    saved = max(r[0] for r in results)
    peak = max(r[1] for r in results)
    step = statistics.median(max(r[2][i] for r in results) for i in range(args.steps))   # the slowest rank's
    return saved, peak, args.seq_length / step


def estimate(args, cp):
    from megatron.guards import memory
    import mpu
    layout = memory.ActivationLayout.for_run("cpu", 4, 0.0, 0.0, context_parallel_size=cp)
    return memory.activation_bytes_saved(args.num_layers, args.seq_length // cp, 1, args.hidden_size,
                                         args.num_attention_heads, 1, mpu.RecomputeConfig(), layout)


def main(argv=None):
    args = parse_args(argv)
    # The ranks' processes (megatron.spawn's fork server, started with this environment) get a fixed glibc mmap
    # threshold: large blocks are mapped and unmapped, never kept in the heap, so a rank's peak resident set is its
    # peak of live allocations (the dynamic threshold lets blocks of up to 32 MiB pile up in the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    for cp in args.sizes:
        if args.seq_length % (2 * cp):
            sys.exit(f"error: --seq-length ({args.seq_length}) is not divisible by 2 x C ({2 * cp})")
    print(f"# context parallelism: L={args.num_layers} h={args.hidden_size} heads={args.num_attention_heads} "
          f"s={args.seq_length} micro batch 1, fp32, dropout 0; activation budget {args.budget_mib:g} MiB per rank")
    print("| C | tokens per rank | activations measured (MiB) | estimate (MiB) | fits budget | peak (MiB) | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for cp in args.sizes:
        saved, peak, tokens_per_second = measure(args, cp)
        mib = saved / 2 ** 20
        print(f"| {cp} | {args.seq_length // cp} | {mib:.1f} | {estimate(args, cp) / 2 ** 20:.1f} | "
              f"{'yes' if mib <= args.budget_mib else 'no'} | {peak:.1f} | {tokens_per_second:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
