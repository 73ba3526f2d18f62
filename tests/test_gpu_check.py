"""The CPU-only parts of the GPU check: tools/gpu_check.sh's argument handling and tools/bench/bench_gpu.py's arguments,
peak table, rows and table, plus one benchmark cell run on the CPU through the real training loop."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))
import bench_gpu  # noqa: E402

SCRIPT = os.path.join(REPO, "tools", "gpu_check.sh")
ROW = {"model": "124m", "precision": "bf16", "stage": 2, "micro_batch": 8, "device": "NVIDIA H100 80GB HBM3",
       "tokens_per_s": 123456.7, "tflops": 345.6, "mfu": 0.3494, "max_allocated_gb": 20.5,
       "model_state_formula_gb": 2.0, "activation_estimate_gb": 8.25, "skipped": 0, "error": None}


def _gpu_check(*args, env=None):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_dry_run_prints_the_test_and_bench_commands():
    done = _gpu_check("--dry-run", "--models", "124m", "--stages", "2,3", env={"GPU_COUNT": "2"})
    assert done.returncode == 0, done.stderr
    plan, tests, bench = done.stdout.strip().splitlines()
    assert plan.startswith("plan: 2 GPUs: ")
    assert tests.startswith("timeout 240 ") and "-m pytest -q -rs --device cuda" in tests   # -rs: skips named
    for name in ("model/test_mpu.py", "model/test_gpt2_model.py", "zero/test_zero_engine.py",
                 "zero/test_activation_checkpointing.py", "checkpoint/test_zero_checkpoint.py"):
        assert f"tests/{name}" in tests
    assert bench.startswith("timeout 330 ") and bench.endswith("--models 124m --stages 2,3")
    only = _gpu_check("--dry-run", "--bench-only").stdout.strip().splitlines()
    assert len(only) == 1 and "bench_gpu.py" in only[0]


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--models"], "--models needs a value"),
    (["--tests-only", "--bench-only"], "leave nothing to run"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    done = _gpu_check(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


PLANS = {
    "1": "plan: 1 GPU: single-rank tests only; every multi-rank test is skipped (one NCCL rank per GPU)",
    "2": "plan: 2 GPUs: tests with up to 2 ranks, one NCCL rank per GPU; tests with more ranks are skipped",
    "8": "plan: 8 GPUs: tests with up to 8 ranks, one NCCL rank per GPU; tests with more ranks are skipped",
}


@pytest.mark.parametrize("gpus", sorted(PLANS))
def test_dry_run_plan_puts_at_most_one_rank_per_gpu(gpus):
    done = _gpu_check("--dry-run", "--tests-only", env={"GPU_COUNT": gpus})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == PLANS[gpus]


@pytest.mark.parametrize("world_size,gpus,refused", [(1, 1, False), (2, 1, True), (2, 2, False), (4, 2, True),
                                                     (4, 8, False), (8, 8, False), (9, 8, True)])
def test_launcher_refuses_more_nccl_ranks_than_gpus(monkeypatch, world_size, gpus, refused):
    """What the plan rests on: megatron/spawn.py puts rank r on GPU r and refuses (under pytest: skips) a launch with
    more ranks than GPUs (`rank % device_count` put two NCCL ranks on one GPU); gloo (the CPU) is never refused."""
    import torch
    from megatron import spawn
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("MEGATRON_TEST_DEVICE", "cpu")
    assert spawn.too_many_ranks(world_size) is None
    monkeypatch.setenv("MEGATRON_TEST_DEVICE", "cuda")
    message = spawn.too_many_ranks(world_size)
    if not refused:
        assert message is None
        return
    assert message == (f"{world_size} NCCL ranks need {world_size} GPUs (one rank per GPU); this machine has "
                       f"{gpus}")
    with pytest.raises(pytest.skip.Exception, match="NCCL ranks need"):   # before any worker starts
        spawn.run_distributed(abs, world_size, args=(-1,))


def test_bad_timeout_is_refused():
    done = _gpu_check("--dry-run", env={"TEST_TIMEOUT": "4m"})
    assert done.returncode == 2 and "whole seconds" in done.stderr
    done = _gpu_check("--dry-run", env={"GPU_COUNT": "two"})
    assert done.returncode == 2 and "GPU_COUNT must be a whole number" in done.stderr


def test_without_cuda_it_says_so_and_exits_1():
    done = _gpu_check(env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and "no CUDA device" in done.stderr


def test_bench_arguments():
    args = bench_gpu.parse_args([])
    assert (args.models, args.precisions, args.device) == (["124m", "1.3b"], ["bf16", "fp16"], "cuda")
    assert args.stages in ([2], [2, 3]) and args.stages == bench_gpu.default_stages()
    assert bench_gpu.parse_args(["--stages", "2,3"]).stages == [2, 3]
    for bad in (["--models", "124m,7b"], ["--stages", "two"], ["--stages", "4"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as error:
            bench_gpu.parse_args(bad)
        assert error.value.code == 2


def test_model_shapes_are_gpt2_124m_and_1_3b():
    def params(m):    # GPT-2 with the vocabulary padded to 128 and a tied head
        h, vocab = m["hidden"], -(-m["vocab"] // 128) * 128
        return (vocab + m["seq"]) * h + m["layers"] * (12 * h * h + 13 * h) + 2 * h
    assert round(params(bench_gpu.MODELS["124m"]) / 1e6) == 124
    assert round(params(bench_gpu.MODELS["1.3b"]) / 1e8) == 13


def test_peak_table():
    assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench_gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_gpu.peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert bench_gpu.peak_tflops("Some Future GPU") is None
    assert bench_gpu.peak_tflops("Some Future GPU", override=500.0) == 500.0


def test_rows_and_table():
    line = bench_gpu.format_row(ROW)
    assert line == "| 124m | bf16 | 2 | 8 | 123,457 | 345.6 | 34.9% | 20.50 | 2.00 | 10.25 |  |"
    failed = bench_gpu.format_row({"model": "1.3b", "precision": "fp16", "stage": 2, "error": "CUDA out of memory"})
    assert failed.startswith("| 1.3b | fp16 | 2 |") and "failed: CUDA out of memory" in failed
    cpu = bench_gpu.format_row({**ROW, "mfu": None, "max_allocated_gb": None, "skipped": 3})
    assert "| n/a | n/a |" in cpu and "3 skipped (fp16 overflow)" in cpu
    table = bench_gpu.format_table([ROW], "NVIDIA H100").splitlines()
    assert table == ["# device: NVIDIA H100", bench_gpu.HEADER, bench_gpu.RULE, line]
    log = "noise\n" + "\n".join([bench_gpu.HEADER, bench_gpu.RULE, line, failed, "", bench_gpu.HEADER,
                                 bench_gpu.RULE, line, failed])
    assert bench_gpu.table_from_log(log).splitlines() == [bench_gpu.HEADER, bench_gpu.RULE, line, failed]


def test_one_cell_on_the_cpu_through_the_training_loop(tmp_path):
    """The plumbing on a CPU: a tiny GPT-2 trained by pretrain_gpt.py under ZeRO-2; TFLOP/s per token is
    Megatron's formula for that shape, the model-state formula the ZeRO paper's 16 bytes per parameter (fp32)."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench", "bench_gpu.py"), "--models", "tiny",
                           "--precisions", "fp32", "--stages", "2", "--device", "cpu", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    m = bench_gpu.MODELS["tiny"]
    L, h, s, vocab = m["layers"], m["hidden"], m["seq"], -(-m["vocab"] // 128) * 128
    # matmul FLOPs per token and forward: per layer qkv 2*3h*h, projection 2*h*h, MLP 2*2*4h*h, attention scores
    # and values 2*2*s*h; the head 2*h*V. Forward + backward = 3 forwards.
    flops_per_token = 3 * (L * (2 * 3 * h * h + 2 * h * h + 2 * 2 * 4 * h * h + 2 * 2 * s * h) + 2 * h * vocab)
    assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["max_allocated_gb"] is None
    assert row["tflops"] * 1e12 / row["tokens_per_s"] == pytest.approx(flops_per_token, rel=1e-6)
    params = (vocab + s) * h + L * (12 * h * h + 13 * h) + 2 * h
    assert row["model_state_formula_gb"] * 2 ** 30 == pytest.approx(16 * params, rel=0.01)
    assert done.stdout.strip().splitlines()[-1] == bench_gpu.format_row(row)


def test_bench_summaries_are_medians_with_spread_and_paired_ratios():
    """bench_train and bench_zero report the median of the repeats, their min-max, and the median of per-repeat
    ratios (each ratio from one repeat), not the best repeat."""
    import bench_common
    import bench_train
    import bench_zero
    assert bench_common.median_and_spread([5.0, 1.0, 3.0, float("nan")]) == (3.0, 1.0, 5.0)
    samples = {"plain PyTorch": [100.0, 50.0, 100.0, 100.0, 10.0], "ours": [110.0, 60.0, 90.0, 120.0, 12.0]}
    # per-round ratios 1.1, 1.2, 0.9, 1.2, 1.2; the ratio of the medians would be 90 / 100 = 0.9
    assert bench_train.summarize(samples)["ours"] == pytest.approx((90.0, 12.0, 120.0, 1.2, 0.9, 1.2))

    def run(tokens_per_s, forward_ms=10.0):
        phases = {"forward": forward_ms, "backward": 2 * forward_ms, "step": 1.0}
        return [{"tokens_per_s": tokens_per_s, "state_bytes": 8.0, "peak_rss_mb": 100.0, "params": 1,
                 "phase_ms": phases}] * 2
    runs = {"ddp-fp32": [run(100.0), run(50.0), run(100.0)],
            "zero2-fp32": [run(120.0, 30.0), run(40.0, 10.0), run(150.0, 20.0)]}
    lines = bench_zero.throughput_table(runs, 2)
    zero2 = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert zero2[:5] == ["zero2-fp32", "120", "40-150", "1.20", "0.80-1.50"]
    # the phase table: each phase's median over repeats (forward 10/20/30 -> 20), and their sum
    phases = [cell.strip() for cell in bench_zero.phase_table(runs)[3].split("|")[1:-1]]
    assert phases == ["zero2-fp32", "20.0", "40.0", "1.0", "61.0"]
    runs["ds2-fp32"] = [run(100.0), run(80.0), run(100.0)]     # our stage 2 / DeepSpeed's: 1.2, 0.5, 1.5
    assert bench_zero.deepspeed_ratio_lines(runs) == ["# zero2-fp32 / ds2-fp32: per-repeat median 1.20x (0.50-1.50)"]


def test_bench_zero_comm_table_gives_bytes_ideal_and_calls_per_op():
    """A comm row: MB sent, the ideal volume for its stage, their ratio, and per op its MB and number of calls (how
    many collectives the step launches: stage 3's gathers are one broadcast per owner of each unit's runs)."""
    import bench_zero
    mb = 2 ** 20
    measured = {2: {"zero3-fp32": ({"broadcast": 10 * mb, "reduce": 10 * mb, "all_reduce": 0.0}, 20 * mb, 0, {
        "broadcast": 9, "reduce": 6, "all_reduce": 1}), "zero2-fp32": ({"broadcast": 5 * mb, "reduce": 10 * mb},
                                                                      20 * mb, 0, {"broadcast": 1, "reduce": 6})}}
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in bench_zero.comm_table(measured)[2:]]
    # stage 3, dp 2, no persistent parameters: reduce-scatter + one gather = (1/2 + 1/2) x 20 MB
    assert rows[0] == ["2", "zero3-fp32", "20.00", "20.00", "1.000", "broadcast 10.00 (9 calls), reduce 10.00 (6 calls)"]
    assert rows[1] == ["2", "zero2-fp32", "15.00", "20.00", "0.750", "broadcast 5.00 (1 call), reduce 10.00 (6 calls)"]
