"""The benchmarks' precision detection: bf16 is benchmarked by default only where the CPU has it natively."""
import os
import sys

from tests.helpers import REPO

sys.path.insert(0, os.path.join(REPO, "tools", "bench"))

import bench_common  # noqa: E402


def test_cpu_bf16_flags_read_from_cpuinfo(tmp_path):
    emulated = tmp_path / "amd"
    emulated.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2\n")
    native = tmp_path / "sapphire"
    native.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert bench_common.cpu_bf16_flags(str(emulated)) == []
    assert bench_common.cpu_bf16_flags(str(native)) == ["avx512_bf16", "amx_bf16"]
    assert bench_common.cpu_bf16_flags(str(tmp_path / "missing")) == []


def test_default_precisions_follow_the_flags(monkeypatch):
    monkeypatch.setattr(bench_common, "cpu_bf16_flags", lambda cpuinfo="/proc/cpuinfo": [])
    assert bench_common.default_precisions() == ["fp32"]
    assert "emulated" in bench_common.precision_header()
    monkeypatch.setattr(bench_common, "cpu_bf16_flags", lambda cpuinfo="/proc/cpuinfo": ["amx_bf16"])
    assert bench_common.default_precisions() == ["fp32", "bf16"]
    assert "native on this CPU (amx_bf16)" in bench_common.precision_header()


def test_init_single_process_takes_backend_and_device_from_mpu(monkeypatch):
    """On a GPU: NCCL (mpu's backend), the GPU of LOCAL_RANK (mpu's device) set before the group exists, and a free
    port as the rendezvous, whatever MASTER_PORT says (never gloo on CUDA tensors, never a fixed port)."""
    import torch
    import torch.distributed as dist
    import mpu
    calls = []
    monkeypatch.setattr(mpu, "get_device", lambda: torch.device("cuda", 3))
    monkeypatch.setattr(mpu, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(mpu, "initialize_model_parallel", lambda size: calls.append(("mpu", size)))
    monkeypatch.setenv("MASTER_PORT", "not read")
    bench_common.init_single_process()
    (set_device, (backend, kwargs), groups) = calls
    assert set_device == ("set_device", torch.device("cuda", 3)) and groups == ("mpu", 1)
    assert backend == "nccl" and (kwargs["rank"], kwargs["world_size"]) == (0, 1)
    address, port = kwargs["init_method"].removeprefix("tcp://").split(":")
    assert address == "127.0.0.1" and port.isdigit()


def test_init_single_process_on_the_cpu_is_gloo():
    import torch.distributed as dist
    import mpu
    bench_common.init_single_process()
    try:
        assert dist.get_backend() == mpu.get_backend() == "gloo" and mpu.get_model_parallel_world_size() == 1
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
