"""Helpers shared by the benchmark commands."""


def peak_rss_mb():
    """Peak resident memory of this process alone, in MB (VmHWM). Not ru_maxrss: Linux keeps that across
    fork+exec, so a spawned worker would report its parent's peak whenever the parent's was higher."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU flags that give native bf16 matmuls (empty: bf16 is emulated, ~100x slower than fp32 here)."""
    try:
        with open(cpuinfo) as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


def precision_header():
    """One line for a benchmark's header: where bf16 is native, and which precisions run by default."""
    import torch
    if torch.cuda.is_available():
        return "# bf16: CUDA (native); default precisions fp32, bf16"
    flags = cpu_bf16_flags()
    if flags:
        return f"# bf16: native on this CPU ({', '.join(flags)}); default precisions fp32, bf16"
    return ("# bf16: emulated on this CPU (no avx512_bf16/amx_bf16: bf16 matmul ~100x slower than fp32); "
            "default precision fp32 only (pass bf16 explicitly to measure it anyway)")


def default_precisions():
    """fp32, plus bf16 where it is native (CUDA, or a CPU with avx512_bf16/amx_bf16)."""
    import torch
    return ["fp32", "bf16"] if torch.cuda.is_available() or cpu_bf16_flags() else ["fp32"]


def init_single_process():
    """torch.distributed and mpu's groups for one process. Backend and device come from mpu (NCCL on the GPU of
    LOCAL_RANK, gloo on the CPU), so a benchmark never runs gloo on CUDA tensors; the GPU is set before the group
    exists (NCCL binds a communicator to the current device). The rendezvous is a free port handed to
    init_method, not MASTER_PORT: a fixed or inherited port may be another job's, and a subprocess the benchmark
    starts must not inherit the port this process's store holds."""
    import torch
    import torch.distributed as dist
    import mpu
    from megatron.spawn import free_port
    device = mpu.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(mpu.get_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.initialize_model_parallel(1)


def median_and_spread(values):
    """(median, min, max) of repeated measurements: the figure and its spread (NaN for none)."""
    import statistics
    values = [v for v in values if v == v]
    if not values:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(values), min(values), max(values)


def write_json_rows(path, rows):
    """Rewrite `path` with every row so far (what a run killed now keeps): written aside, then renamed over it."""
    import json
    import os
    with open(path + ".tmp", "w") as handle:
        json.dump(rows, handle, indent=1)
    os.replace(path + ".tmp", path)
