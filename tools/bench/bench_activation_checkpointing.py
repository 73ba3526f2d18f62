"""Benchmark activation recomputation on the parallel transformer layers (no embeddings, final LayerNorm or head).

    python tools/bench/bench_activation_checkpointing.py                       # L=8 h=512 s=512, mp 1 and 2
    python tools/bench/bench_activation_checkpointing.py --micro-batch 1 --steps 3 --mp 2 --modes off partitioned

For each model-parallel size and mode, fresh processes (so peak RSS is per configuration) build
mpu.ParallelTransformer with dropout 0.1, run one warm-up step, one step whose forward is counted with
torch.autograd.graph.saved_tensors_hooks (the distinct storages kept for backward, parameters excluded: the
activation bytes per rank, next to memory.activation_bytes_saved's formula for the same layout), then `--steps` timed
forward+backward steps. Modes:

    off                   no recomputation
    selective             --recompute-granularity selective: each layer's attention core recomputed (mpu's
                          checkpoint), its s x s scores never kept
    on                    full recomputation through zero.checkpointing, one chunk per layer, inputs kept whole
    partitioned           + partition_activations (each mp rank keeps 1/mp of every chunk input)
    partitioned+cpu       + checkpoint_in_cpu (identical to partitioned on a CPU-only machine)
    partitioned+contiguous + contiguous_checkpointing with num_checkpoints = num_layers
    off+sp, selective+sp, on+sp   the mode with --sequence-parallel (mp > 1 only): each rank's layers take its
                          1/mp of the sequence, the replicated activations are divided by mp

tokens/s counts the tokens of one micro-batch per step (the model-parallel ranks share them). The
one-extra-forward bound is step / (step + no-grad forward) of the "off" run: the speed ratio a checkpointed step
reaches when recomputing costs exactly one more forward (on CPUs the backward is cheaper than 2 forwards, so
this is below the 0.75 of the usual 1:2 forward:backward rule). Peak RSS is the
process's maximum resident set (ru_maxrss, includes torch itself); "peak - built" is that minus the resident set
after the model was built. On CUDA the peak allocated device memory is reported too.
"""
import argparse
import multiprocessing
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import peak_rss_mb  # noqa: E402

MODES = {"off": None, "selective": None, "on": {}, "partitioned": dict(partition_activations=True),
         "partitioned+cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
         "partitioned+contiguous": dict(partition_activations=True, contiguous_checkpointing=True)}
MODES.update({f"{mode}+sp": MODES[mode] for mode in ("off", "selective", "on")})   # --sequence-parallel


def sequence_parallel(mode):
    return mode.endswith("+sp")


def base_mode(mode):
    return mode[:-len("+sp")] if sequence_parallel(mode) else mode


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up and counted steps")
    parser.add_argument("--mp", type=int, nargs="+", default=[1, 2], help="model-parallel sizes")
    parser.add_argument("--modes", nargs="+", default=["off", "selective", "on", "partitioned", "partitioned+cpu",
                                                       "off+sp", "selective+sp"],
                        choices=list(MODES), help="the +sp modes run at mp > 1 only")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, in alternating order; tokens/s is the best")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / mp)")
    return parser.parse_args()


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank, mp_size, mode, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(mp_size),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    import mpu
    from megatron.guards import memory
    from megatron.model.gpt2_model import activation_checkpointing_pair
    from megatron.zero import checkpointing

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // mp_size))
    dist.init_process_group(mpu.get_backend(), rank=rank, world_size=mp_size)
    mpu.initialize_model_parallel(mp_size)
    device = mpu.get_device()
    # The first backward through a custom autograd.Function imports ~35 MiB of modules (sympy, via torch);
    # do it now in every mode, so that "peak - built" measures activations only.
    checkpointing.checkpoint(lambda t: t * 2, torch.ones(1, requires_grad=True)).sum().backward()
    if MODES[mode] is not None:
        options = dict(MODES[mode])
        if options.get("contiguous_checkpointing"):
            options["num_checkpoints"] = args.num_layers
        if mp_size == 1 and options.get("partition_activations"):
            options["partition_activations"] = False  # a no-op at mp=1 (configure would warn)
        checkpointing.configure(mpu, **options)
    mpu.model_parallel_cuda_manual_seed(1234)
    checkpoint_function, rng_tracker = activation_checkpointing_pair()
    recompute = recompute_config(mode)
    model = mpu.ParallelTransformer(args.num_layers, args.hidden_size, args.num_attention_heads, 0.1, 0.1,
                                    checkpoint_function=checkpoint_function, rng_tracker=rng_tracker,
                                    final_layernorm=False, recompute=recompute,   # the layers the formula counts
                                    sequence_parallel=sequence_parallel(mode))
    generator = torch.Generator().manual_seed(7)
    seq = args.seq_length // (mp_size if sequence_parallel(mode) else 1)   # a rank's slice under --sequence-parallel
    shape = (args.micro_batch, seq, args.hidden_size)  # [b, s, h]
    x = torch.randn(*shape, generator=generator).to(device).requires_grad_()
    target = torch.randn(*shape, generator=generator).to(device)
    built_rss = _rss_bytes()

    def step():
        (model(x) * target).sum().backward()

    step()  # warm-up
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)                    # the layers' activations only: not the loss's (target)
    (out * target).sum().backward()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():  # what one extra forward costs: the bound for a checkpointed step
        for _ in range(args.steps):
            model(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    forward_seconds = (time.perf_counter() - start) / args.steps
    peak_rss = peak_rss_mb() * 1024 * 1024
    layout = memory.ActivationLayout.for_run(device.type, 4, 0.1, 0.1,
                                             bool(MODES[mode] and MODES[mode].get("partition_activations")),
                                             sequence_parallel=sequence_parallel(mode))
    formula = memory.activation_bytes_saved(args.num_layers, args.seq_length, args.micro_batch, args.hidden_size,
                                            args.num_attention_heads, mp_size, recompute, layout)
    result = {"saved_bytes": sum(storage.nbytes() for storage in seen.values()), "formula_bytes": formula,
              "peak_rss": peak_rss,
              "peak_over_built": peak_rss - built_rss, "seconds_per_step": elapsed / args.steps,
              "forward_seconds": forward_seconds,
              "device_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def recompute_config(mode):
    """The mpu.RecomputeConfig of a mode: selective, full uniform 1 for the zero.checkpointing modes, or none."""
    import mpu
    if base_mode(mode) == "selective":
        return mpu.RecomputeConfig("selective")
    return mpu.RecomputeConfig.from_checkpoint_activations(MODES[mode] is not None)


def run_configuration(mp_size, mode, args):
    """The worst rank's numbers (max memory, slowest step) for one configuration, in fresh processes."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(rank, mp_size, mode, args, port, queue)) for rank in range(mp_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"mp={mp_size} mode={mode}: a worker failed (exit codes {[p.exitcode for p in procs]})")
    results = [queue.get()[1] for _ in procs]
    return {key: max(r[key] for r in results) if results[0][key] is not None else None for key in results[0]}


def main():
    args = parse_args()
    tokens = args.micro_batch * args.seq_length
    runs = {}  # (mp, mode) -> results of each repeat
    for repeat in range(args.repeats):
        order = [(mp_size, mode) for mp_size in args.mp for mode in args.modes
                 if mp_size > 1 or not sequence_parallel(mode)]
        for key in (order if repeat % 2 == 0 else order[::-1]):  # alternate, so load drift hits every mode
            runs.setdefault(key, []).append(run_configuration(*key, args))
            print(f"done: mp={key[0]} {key[1]} ({repeat + 1}/{args.repeats})", file=sys.stderr, flush=True)
    print(f"# L={args.num_layers} h={args.hidden_size} heads={args.num_attention_heads} s={args.seq_length} "
          f"micro-batch={args.micro_batch} steps={args.steps} repeats={args.repeats} fp32 dropout=0.1, "
          f"torch threads per process={args.threads or 'cores/mp'}; tokens/s: best repeat\n")
    print("| mp | mode | saved activations / rank (MiB) | formula (MiB) | peak RSS (MiB) | peak - built (MiB) | "
          "tokens/s | vs off | one-extra-forward bound |")
    print("|---:|------|---:|---:|---:|---:|---:|---:|---:|")
    for mp_size in args.mp:
        off = runs.get((mp_size, "off"))
        off_speed = tokens / min(r["seconds_per_step"] for r in off) if off else None
        bound = "-"
        if off:  # step / (step + forward): the speed ratio if recomputing costs exactly one more forward
            step, forward = min(r["seconds_per_step"] for r in off), min(r["forward_seconds"] for r in off)
            bound = f"{step / (step + forward):.2f}x"
        for mode in args.modes:
            if (mp_size, mode) not in runs:
                continue
            results = runs[(mp_size, mode)]
            first = results[0]
            speed = tokens / min(r["seconds_per_step"] for r in results)
            ratio = f"{speed / off_speed:.2f}x" if off_speed else "-"
            device_peak = first["device_peak"]
            device = f" (device peak {device_peak / 2**20:.0f} MiB)" if device_peak is not None else ""
            print(f"| {mp_size} | {mode} | {first['saved_bytes'] / 2**20:.1f} | {first['formula_bytes'] / 2**20:.1f} | "
                  f"{first['peak_rss'] / 2**20:.0f} | {first['peak_over_built'] / 2**20:.0f}{device} | {speed:.0f} | "
                  f"{ratio} | {'-' if base_mode(mode) in ('off', 'selective') else bound} |")


if __name__ == "__main__":
    main()
