"""Pipeline parallelism: each stage's start-up (model build time and peak memory) at P = 1, 2, 4; measured 1F1B
bubble vs the formula (P - 1) / (M + P - 1), and tokens/s vs one stage; the interleaved schedule's bubble at
v = 1, 2 model chunks per stage and P = 2, 4 vs (P - 1) / (v M).

    python tools/bench/bench_pipeline.py                       # start-up table; P = 2, M = 2, 4, 8 table
    python tools/bench/bench_pipeline.py --micro-batches 4 8 16 --steps 6 --layers 8
    python tools/bench/bench_pipeline.py --startup-only --layers 8 --hidden 512
    python tools/bench/bench_pipeline.py --interleaved --layers 8 --micro-batches 4 8   # P = 2, 4 x v = 1, 2

Interleaved table: the same cells with mpu's virtual pipeline size v (v = 1: plain 1F1B). Its bubble is the idle
time of a stage over its busy time, (step - compute) / compute, averaged over the stages: what the formula
(P - 1) / (v M) counts (the idle share of the step is then (P - 1) / (v M + P - 1)). With more processes than cores
(P = 4 on a 2-core machine) the stages also wait for a core, which the formula does not know.

Start-up: the stages of a P-process pipeline build their GPT2Model one after another (no two build at once, so
the times do not share the cores); build s is GPT2Model(config) alone, peak MB the rise of the process's peak
resident set over its resident set before the build (/proc/self/status VmHWM, reset through clear_refs), held MB
the stage's parameters. A stage builds only its own layers but still draws the whole model's initial weights
(the others' into a scratch buffer), so its time falls less than its memory.

Each cell runs megatron.pipeline.schedules on gloo processes with a GPT2Model split into P stages (fp32, dropout off).
Bubble = 1 - (time inside forward/backward) / (step time), averaged over the stages: the share of a step a stage
waits for its neighbours (the formula assumes equal stage times and free communication). tokens/s is the same
global batch (M micro-batches) through pp1 on one process and through pp2 on two; on a CPU with one core per
process the pp2 number is the relevant one only relative to pp1 (two processes, two cores). The first step of
each cell is a warm-up and not timed; the median step time of the rest is reported.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _cell(stages, micro_batches, steps, layers, hidden, seq, micro, chunks=1):
    """On every rank of a P-stage pipeline of `chunks` model chunks a stage: (median step s, median compute s)
    over `steps` timed steps."""
    import torch
    import mpu
    from megatron.pipeline import p2p_communication, schedules
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, stages, virtual_pipeline_model_parallel_size=chunks)
    mpu.model_parallel_cuda_manual_seed(1)
    config = GPT2ModelConfig(num_layers=layers, vocab_size=1024, hidden_size=hidden, num_attention_heads=4,
                             max_sequence_length=seq)
    model = GPT2Model(config)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1024, (micro, seq + 1), generator=generator) for _ in range(micro_batches)]
    compute = [0.0]

    def forward_step(iterator, module):
        start = time.perf_counter()
        text = next(iterator)
        losses = module(text[:, :-1], labels=text[:, 1:])
        compute[0] += time.perf_counter() - start
        return (losses.mean(), {}) if mpu.is_pipeline_last_stage() else (losses, {})

    def backward(output, output_grad, index, after_backward):
        start = time.perf_counter()
        if output_grad is None:
            (output / micro_batches).backward()
        else:
            torch.autograd.backward(output, output_grad)
        compute[0] += time.perf_counter() - start
        after_backward()
    spec = p2p_communication.TensorSpec((micro, seq, hidden), torch.float32, torch.device("cpu"))
    run = schedules.get_forward_backward_func()
    step_times, compute_times = [], []
    for step in range(steps + 1):
        compute[0] = 0.0
        torch.distributed.barrier()
        start = time.perf_counter()
        run(forward_step, iter(batches), model, backward, micro_batches, spec)
        elapsed = time.perf_counter() - start
        if step > 0:
            step_times.append(elapsed)
            compute_times.append(compute[0])
    return statistics.median(step_times), statistics.median(compute_times)


def _rss_kb(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _startup(stages, layers, hidden, seq, vocab, repeats):
    """On every rank of a P-stage pipeline: (stage, build s (the fastest of `repeats` builds), peak MB (the
    largest), held MB), the stages built in turn."""
    import gc
    import torch
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, stages)
    config = GPT2ModelConfig(num_layers=layers, vocab_size=vocab, hidden_size=hidden, num_attention_heads=4,
                             max_sequence_length=seq)
    stage = mpu.get_pipeline_model_parallel_rank()
    times, peaks = [], []
    for turn in range(stages):
        torch.distributed.barrier()
        for _ in range(repeats if turn == stage else 0):
            mpu.model_parallel_cuda_manual_seed(1)
            model = None
            gc.collect()
            with open("/proc/self/clear_refs", "w") as clear:   # peak resident set := resident set now
                clear.write("5")
            before = _rss_kb("VmRSS")
            start = time.perf_counter()
            model = GPT2Model(config)
            times.append(time.perf_counter() - start)
            peaks.append((_rss_kb("VmHWM") - before) / 1024)
    torch.distributed.barrier()
    held_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    return stage, min(times), max(peaks), held_mb


def startup_table(layers, hidden, seq, vocab, repeats=3, stage_counts=(1, 2, 4)):
    """Print one markdown table: build time and memory of every stage at each P."""
    from megatron.spawn import run_distributed
    print(f"# start-up: GPT-2 L{layers} h{hidden} s{seq} V{vocab}, fp32, each stage built alone, "
          f"fastest of {repeats} builds")
    print("| P | stage | layers | build s | peak MB | held MB |")
    print("|---|---|---|---|---|---|")
    for stages in stage_counts:
        if layers % stages:
            print(f"| {stages} | - | {layers} layers do not split into {stages} stages | | | |")
            continue
        per_stage = layers // stages
        for stage, elapsed, peak_mb, held_mb in run_distributed(_startup, stages, args=(stages, layers, hidden,
                                                                                         seq, vocab, repeats)):
            print(f"| {stages} | {stage} | {stage * per_stage}-{(stage + 1) * per_stage - 1} | {elapsed:.3f} | "
                  f"{peak_mb:.1f} | {held_mb:.1f} |", flush=True)


def interleaved_table(stage_counts, chunk_counts, micro_batches, steps, layers, hidden, seq, micro):
    """Print one markdown table: measured bubble (idle / busy) of each P x v x M against (P - 1) / (v M)."""
    from megatron.spawn import run_distributed
    print(f"# interleaved 1F1B: GPT-2 L{layers} h{hidden} s{seq}, micro batch {micro}, fp32, gloo, "
          f"{os.cpu_count()} CPUs; median of {steps} steps")
    print("| P | v | M | layers per chunk | bubble measured (idle / busy) | (P-1)/(v M) | step ms |")
    print("|---|---|---|---|---|---|---|")
    for stages in stage_counts:
        for chunks in chunk_counts:
            for m in micro_batches:
                if layers % (stages * chunks) or (chunks > 1 and m % stages):
                    continue
                staged = run_distributed(_cell, stages, args=(stages, m, steps, layers, hidden, seq, micro, chunks))
                bubble = statistics.mean((step - busy) / busy for step, busy in staged)
                step = max(step for step, _ in staged)
                print(f"| {stages} | {chunks} | {m} | {layers // (stages * chunks)} | {bubble:.2f} | "
                      f"{(stages - 1) / (chunks * m):.2f} | {step * 1000:.0f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the start-up table's model")
    parser.add_argument("--startup-only", action="store_true", help="print the start-up table only")
    parser.add_argument("--interleaved", action="store_true",
                        help="print the interleaved table only (P = 2, 4 x v = 1, 2 at each --micro-batches)")
    args = parser.parse_args()
    from megatron.spawn import run_distributed
    if args.interleaved:
        interleaved_table((2, 4), (1, 2), args.micro_batches, args.steps, args.layers, args.hidden, args.seq,
                          args.micro)
        return
    startup_table(args.layers, args.hidden, args.seq, args.vocab)
    if args.startup_only:
        return
    print(f"# GPT-2 L{args.layers} h{args.hidden} s{args.seq}, micro batch {args.micro}, fp32, gloo, "
          f"{os.cpu_count()} CPUs; median of {args.steps} steps")
    print(f"| P | M | bubble measured | (P-1)/(M+P-1) | pp1 tokens/s | pp{args.stages} tokens/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for m in args.micro_batches:
        cell = (args.steps, args.layers, args.hidden, args.seq, args.micro)
        single = run_distributed(_cell, 1, args=(1, m) + cell)[0]
        staged = run_distributed(_cell, args.stages, args=(args.stages, m) + cell)
        step = max(s for s, _ in staged)
        bubble = statistics.mean(1 - c / s for s, c in staged)
        tokens = m * args.micro * args.seq
        formula = (args.stages - 1) / (m + args.stages - 1)
        print(f"| {args.stages} | {m} | {bubble:.2f} | {formula:.2f} | {tokens / single[0]:.0f} | "
              f"{tokens / step:.0f} | {single[0] / step:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
