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
