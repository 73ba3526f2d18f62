"""The CPU-only parts of the GPU check: tools/gpu_check.sh's dry run (plan, commands, expected time) and argument
handling; tools/bench/bench_gpu.py's arguments, peak table, estimates, rows kept as measured, and one benchmark cell
run on the CPU through the real training loop on a port of its own."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import port_taken, REPO
from tests import warm_python
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))
import bench_gpu  # noqa: E402

SCRIPT = os.path.join(REPO, "tools", "gpu_check.sh")
ROW = {"model": "124m", "precision": "bf16", "stage": 2, "compile": "compiled", "micro_batch": 8, "device": "NVIDIA H100 80GB HBM3",
       "peak_tflops": 989.5, "tokens_per_s": 123456.7, "tflops": 345.6, "mfu": 0.3494, "max_allocated_gb": 20.5,
       "model_state_formula_gb": 2.0, "activation_estimate_gb": 8.25, "skipped": 0, "error": None}
TESTS = ("model/test_mpu.py", "model/test_gpt2_model.py", "zero/test_zero_engine.py",
         "zero/test_activation_checkpointing.py", "checkpoint/test_zero_checkpoint.py",
         "model/test_chunked_cross_entropy.py", "inference/test_static_decode.py",
         "model/test_context_parallel_attention.py", "model/test_moe.py", "zero/test_muon.py",
         "model/test_moe_host_reads.py")


def _gpu_check(*args, env=None):
    """The script with this interpreter as its PYTHON (the dry run asks bench_gpu.py for (b)'s plan); GPU_COUNT only
    where a test sets it."""
    inherited = {key: value for key, value in os.environ.items() if key != "GPU_COUNT"}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          env={**inherited, "PYTHON": sys.executable, **(env or {})})


def test_dry_run_shows_plan_commands_and_expected_time_within_8_minutes():
    """On this CPU (no GPU_COUNT, no GPU) the dry run plans the one-GPU machine: (a)'s files, what one GPU runs and
    skips, (b)'s four cells (124M and 350M, bf16, ZeRO-2 and 3), both commands, the expected time and the bound."""
    done = _gpu_check("--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "gpu_check dry run (nothing runs): the plan for 1 GPU"
    assert lines[1].startswith("(a) device-agnostic tests on CUDA, limit 90 s, expected ~75 s (30 s measured on one "
                               "H200 for the first five files, the rest a guess)")
    assert lines[2].split() == [f"tests/{name}" for name in TESTS]
    assert "1-rank NCCL group" in done.stdout and "NCCL refuses two ranks on one GPU" in done.stdout
    (tests,) = [line for line in lines if "-m pytest" in line]
    assert tests.strip().startswith("$ timeout 90 ") and "-m pytest -q -rs --device cuda" in tests
    assert all(f"tests/{name}" in tests for name in TESTS)
    cells = [line.split(":")[0].strip() for line in lines if re.match(r"\s+\S+ \S+ ZeRO-\d:", line)]
    assert cells == ["124m bf16 ZeRO-2", "124m bf16 ZeRO-3", "350m bf16 ZeRO-2", "350m bf16 ZeRO-3"]
    (bench,) = [line for line in lines if "bench_gpu.py" in line and "$ timeout" in line]
    assert bench.strip().startswith("$ timeout 270 ") and "--json runs/gpu_check/bench_gpu.json" in bench
    assert bench.endswith("--cell-timeout 75")
    (generate,) = [line for line in lines if "bench_generate.py" in line]
    assert generate.strip().startswith("$ timeout 60 ") and "--device cuda --dtype bfloat16" in generate
    assert "--json runs/gpu_check/generate.json" in generate
    (targets,) = [line for line in lines if "gpu_targets.py" in line]
    assert "--training runs/gpu_check/bench_gpu.json --generation runs/gpu_check/generate.json" in targets
    (client,) = [line for line in lines if "ds_client_check.py" in line]
    assert client.strip() == f"$ timeout 45 {sys.executable} tools/ds_client_check.py"
    assert any(line.startswith("(c) a DeepSpeed-style client") and "limit 45 s" in line for line in lines)
    expected, bound = map(float, re.search(r"expected ~([\d.]+) min; at most ([\d.]+) min", lines[-1]).groups())
    assert 0 < expected < bound <= 8.0, lines[-1]
    # compile counted: each default (compiled on CUDA) cell is start-up 20 s + compile 30 s + its steps; the
    # whole: 15 s of queries + (a) 75 + (b)'s cells + generation 40 + (c) 20
    cell_seconds = [int(x) for x in re.findall(r"ZeRO-\d: .* steps, ~(\d+) s", done.stdout)]
    assert all(seconds >= 50 for seconds in cell_seconds) and "30 s of compile per compiled cell" in done.stdout
    # within 5 s: the cells' printed seconds and the minutes are rounded
    assert abs(expected * 60 - (15 + 75 + sum(cell_seconds) + 40 + 20)) <= 5, (expected, cell_seconds)


def test_dry_run_passes_bench_options_and_parts_alone():
    done = _gpu_check("--dry-run", "--bench-only", "--models", "124m", "--stages", "2")
    assert done.returncode == 0, done.stderr
    assert "(a)" not in done.stdout and "ZeRO-3" not in done.stdout
    assert "expected: ~" in done.stdout and " 1 cell " in done.stdout
    (bench,) = [line for line in done.stdout.splitlines() if "$ timeout" in line and "bench_gpu.py" in line]
    assert bench.endswith("--cell-timeout 75 --models 124m --stages 2")
    only = _gpu_check("--dry-run", "--tests-only", env={"GPU_COUNT": "2"}).stdout
    assert "(b)" not in only and "bench_gpu.py" not in only and "(c)" not in only
    client = _gpu_check("--dry-run", "--client-only").stdout
    assert "(a)" not in client and "(b)" not in client and "$ timeout 45 " in client
    assert "at most 1.0 min" in client          # 15 s of device queries + CLIENT_TIMEOUT 45 s


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--models"], "--models needs a value"),
    (["--tests-only", "--bench-only"], "leave nothing to run"),
    (["--bench-only", "--client-only"], "leave nothing to run"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    done = _gpu_check(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


PLANS = {
    "0": "no GPU visible: (a) needs at least one",
    "1": "1 GPU: every 1-rank test runs in a 1-rank NCCL group",
    "2": "2 GPUs: tests with up to 2 ranks, one NCCL rank per GPU (collectives across ranks); tests with more",
    "8": "8 GPUs: tests with up to 8 ranks, one NCCL rank per GPU (collectives across ranks); tests with more",
}


@pytest.mark.parametrize("gpus", sorted(PLANS))
def test_dry_run_plan_puts_at_most_one_rank_per_gpu(gpus):
    done = _gpu_check("--dry-run", "--tests-only", env={"GPU_COUNT": gpus})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[3].strip().startswith(PLANS[gpus])


@pytest.mark.parametrize("world_size,gpus,refused", [(1, 1, False), (2, 1, True), (2, 2, False), (4, 2, True),
                                                     (4, 8, False), (8, 8, False), (9, 8, True)])
def test_launcher_refuses_more_nccl_ranks_than_gpus(monkeypatch, world_size, gpus, refused):
    """What the plan rests on: megatron/spawn/ puts rank r on GPU r and refuses (under pytest: skips) a launch with
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


@pytest.mark.parametrize("variable,value,message", [("TEST_TIMEOUT", "4m", "whole seconds"),
                                                    ("CELL_TIMEOUT", "1.5", "whole seconds"),
                                                    ("CLIENT_TIMEOUT", "45s", "whole seconds"),
                                                    ("GPU_COUNT", "two", "GPU_COUNT must be a whole number")])
def test_bad_settings_are_refused(variable, value, message):
    done = _gpu_check("--dry-run", env={variable: value})
    assert done.returncode == 2 and message in done.stderr


def test_without_cuda_it_says_so_and_exits_1():
    done = _gpu_check(env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and "no CUDA device" in done.stderr


def test_bench_arguments():
    args = bench_gpu.parse_args([])
    assert (args.models, args.precisions, args.stages, args.device) == (["124m", "350m"], ["bf16"], [2, 3], "cuda")
    assert bench_gpu.parse_args(["--stages", "2"]).stages == [2]
    for bad in (["--models", "124m,7b"], ["--stages", "two"], ["--stages", "4"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as error:
            bench_gpu.parse_args(bad)
        assert error.value.code == 2


def _params(m):
    """GPT-2's parameter count with the vocabulary padded to 128 and a tied head."""
    h, vocab = m["hidden"], -(-m["vocab"] // 128) * 128
    return (vocab + m["seq"]) * h + m["layers"] * (12 * h * h + 13 * h) + 2 * h


def test_model_shapes_are_gpt2_124m_and_350m():
    assert round(_params(bench_gpu.MODELS["124m"]) / 1e6) == 124
    assert round(_params(bench_gpu.MODELS["350m"]) / 1e6) == 355        # GPT-2 medium
    assert round(_params(bench_gpu.MODELS["1.3b"]) / 1e8) == 13


def test_peak_is_looked_up_by_exact_name_and_unknown_gets_none():
    assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3")[0] == 989.5       # SXM
    assert bench_gpu.peak_tflops("NVIDIA H100 PCIe")[0] == 756.5
    assert bench_gpu.peak_tflops("NVIDIA H100 NVL")[0] == 835.5
    assert bench_gpu.peak_tflops("NVIDIA A100-SXM4-40GB")[0] == bench_gpu.peak_tflops("NVIDIA A100 80GB PCIe")[0] == 312
    for near in ("NVIDIA H100", "NVIDIA H100 80GB HBM3 ", "H100", "Some Future GPU"):     # never a near match
        peak, how = bench_gpu.peak_tflops(near)
        assert peak is None and how.startswith("unknown peak")
    # one name, two parts: the board's power limit decides (H200 SXM 700 W, NVL 600 W); unread or mixed: unknown
    assert bench_gpu.peak_tflops("NVIDIA H200", [700.0])[0] == 989.5
    assert bench_gpu.peak_tflops("NVIDIA H200", [600.0, 600.0])[0] == 835.5
    assert bench_gpu.peak_tflops("NVIDIA H200", [])[0] is None
    assert bench_gpu.peak_tflops("NVIDIA H200", [600.0, 700.0])[0] is None


def test_device_peak_override_and_unknown(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H200")
    monkeypatch.setattr(bench_gpu, "power_limits_w", lambda name: [700.0])
    assert bench_gpu.device_and_peak(bench_gpu.parse_args([]))[:2] == ("NVIDIA H200", 989.5)
    assert bench_gpu.device_and_peak(bench_gpu.parse_args(["--peak-tflops", "500"]))[1:] == (500.0, "--peak-tflops")
    monkeypatch.setattr(bench_gpu, "power_limits_w", lambda name: [])
    name, peak, how = bench_gpu.device_and_peak(bench_gpu.parse_args([]))
    assert peak is None and bench_gpu.device_line(name, peak, how).endswith("no MFU (--peak-tflops sets it)")


def test_activation_estimate_knows_flash_attention_and_the_chunked_loss(monkeypatch):
    """No s x s term (SDPA's flash kernels keep no scores): linear in the sequence length. The chunked loss adds the
    logits and their gradient in the training precision (4 bytes per logit in bf16, 8 in fp32) and one fp32 chunk
    of tokens (all 512 tokens here: 1024 logits a token is below a chunk's 2^24)."""
    shape = dict(layers=2, hidden=64, heads=4, vocab=1000, micro=2)
    monkeypatch.setitem(bench_gpu.MODELS, "s256", dict(shape, seq=256))
    monkeypatch.setitem(bench_gpu.MODELS, "s512", dict(shape, seq=512))
    estimate = bench_gpu.activation_estimate_bytes
    assert estimate("s512", 2, "bf16") == 2 * estimate("s256", 2, "bf16")
    s, b, h, a, L, V = 256, 2, 64, 4, 2, 1024
    layer = 34 * s * b * h + 4 * a * s * b
    assert estimate("s256", 2, "bf16") == L * layer + (4 + 4) * s * b * V
    assert estimate("s256", 2, "fp32") == L * (2 * 34 * s * b * h + 4 * a * s * b) + (8 + 4) * s * b * V
    assert estimate("s256", 2, "bf16", checkpoint_activations=True) == L * 2 * s * b * h + layer + 8 * s * b * V
    # a compiled run's loss (mpu/fused.py) keeps the logits only, its gradient written into them: 2 bytes a logit
    assert estimate("s256", 2, "bf16", fused_loss=True) == L * layer + 2 * s * b * V
    assert estimate("s256", 2, "fp32", fused_loss=True) == L * (2 * 34 * s * b * h + 4 * a * s * b) + 4 * s * b * V


def test_rows_and_table():
    line = bench_gpu.format_row(ROW)
    assert line == "| 124m | bf16 | 2 | compiled | 8 | 123,457 | 345.6 | 34.9% | 20.50 | 2.00 | 10.25 |  |"
    failed = bench_gpu.format_row({"model": "350m", "precision": "bf16", "stage": 3, "error": "CUDA out of memory"})
    assert failed.startswith("| 350m | bf16 | 3 |") and "failed: CUDA out of memory" in failed
    cpu = bench_gpu.format_row({**ROW, "mfu": None, "max_allocated_gb": None, "skipped": 3,
                                "note": "exit status -6 in teardown"})
    assert "| n/a | n/a |" in cpu and "3 skipped (fp16 overflow); exit status -6 in teardown |" in cpu
    header = bench_gpu.device_line("NVIDIA H100 80GB HBM3", 989.5, "datasheet peak of NVIDIA H100 80GB HBM3")
    table = bench_gpu.format_table([ROW], header).splitlines()
    assert table == [header, bench_gpu.HEADER, bench_gpu.RULE, line]
    log = "noise\n" + "\n".join([header, bench_gpu.HEADER, bench_gpu.RULE, line, failed, "", header, bench_gpu.HEADER,
                                 bench_gpu.RULE, line, failed])
    assert bench_gpu.table_from_log(log).splitlines() == [header, bench_gpu.HEADER, bench_gpu.RULE, line, failed]


def _completed(stdout="", stderr="", returncode=0):
    return subprocess.CompletedProcess([], returncode, stdout, stderr)


def test_a_row_printed_before_a_teardown_abort_or_timeout_is_kept(monkeypatch):
    args = bench_gpu.parse_args(["--device", "cpu"])
    printed = "noise\nBENCH_GPU_ROW " + json.dumps(ROW) + "\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: _completed(printed, "Aborted", -6))
    assert bench_gpu.measure_cell(("124m", "bf16", 2, "default"), args) == {**ROW, "note": "exit status -6 in teardown"}

    def timeout(*a, **k):
        raise subprocess.TimeoutExpired([], 75, output=printed.encode())
    monkeypatch.setattr(subprocess, "run", timeout)
    assert bench_gpu.measure_cell(("124m", "bf16", 2, "default"), args)["note"] == "timed out in teardown after 75 s"


def test_each_cell_gets_a_free_port_and_a_taken_one_is_retried_once(monkeypatch):
    args = bench_gpu.parse_args(["--device", "cpu"])
    ports, outcomes = [], [_completed(stderr="RuntimeError: ... EADDRINUSE ..."), _completed("BENCH_GPU_ROW " +
                                                                                              json.dumps(ROW))]

    def run(command, env, **kwargs):
        ports.append(env["MASTER_PORT"])
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["WORLD_SIZE"] == "1"
        return outcomes.pop(0)
    monkeypatch.setattr(subprocess, "run", run)
    assert bench_gpu.measure_cell(("124m", "bf16", 2, "default"), args) == ROW
    assert len(ports) == 2 and all(port.isdigit() for port in ports)
    outcomes[:] = [_completed(stderr="EADDRINUSE")] * 2
    assert "EADDRINUSE" in bench_gpu.measure_cell(("124m", "bf16", 2, "default"), args)["error"]


def test_rows_reach_the_json_as_they_are_measured(monkeypatch, tmp_path):
    """A run killed after its first cell (a timeout of gpu_check's part (b), say) keeps that cell's row."""
    out = tmp_path / "rows.json"

    def measure(cell, args):
        if cell[2] == 3:
            raise KeyboardInterrupt   # what a kill in the second cell looks like to this loop
        return {**ROW, "stage": cell[2]}
    monkeypatch.setattr(bench_gpu, "measure_cell", measure)
    with pytest.raises(KeyboardInterrupt):
        bench_gpu.main(["--device", "cpu", "--models", "124m", "--stages", "2,3", "--json", str(out)])
    assert json.loads(out.read_text()) == [{**ROW, "stage": 2}]


def test_one_cell_on_the_cpu_through_the_training_loop(tmp_path):
    """The plumbing on a CPU: a tiny GPT-2 trained by pretrain_gpt.py under ZeRO-2 while the habitual ports 6000 and
    29500 are taken (a cell rendezvous on a free port of its own); TFLOP/s per token is Megatron's formula for that
    shape, the model-state formula the ZeRO paper's 16 bytes per parameter (fp32)."""
    out = tmp_path / "rows.json"
    with port_taken(6000), port_taken(29500):
        done = warm_python.run([sys.executable, os.path.join(REPO, "tools", "bench", "bench_gpu.py"), "--models",
                                "tiny", "--precisions", "fp32", "--stages", "2", "--device", "cpu", "--steps", "2",
                                "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    m = bench_gpu.MODELS["tiny"]
    L, h, s, vocab = m["layers"], m["hidden"], m["seq"], -(-m["vocab"] // 128) * 128
    # matmul FLOPs per token and forward: per layer qkv 2*3h*h, projection 2*h*h, MLP 2*2*4h*h, attention scores
    # and values 2*2*s*h; the head 2*h*V. Forward + backward = 3 forwards.
    flops_per_token = 3 * (L * (2 * 3 * h * h + 2 * h * h + 2 * 2 * 4 * h * h + 2 * 2 * s * h) + 2 * h * vocab)
    assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["max_allocated_gb"] is None
    assert row["tflops"] * 1e12 / row["tokens_per_s"] == pytest.approx(flops_per_token, rel=1e-6)
    assert row["model_state_formula_gb"] * 2 ** 30 == pytest.approx(16 * _params(m), rel=0.01)
    assert row.get("note") is None                                   # the cell left its process group cleanly
    assert row["compile"] == "eager"                                 # the run's own default on a CPU
    assert done.stdout.strip().splitlines()[-1] == bench_gpu.format_row(row)


def test_compile_modes_and_the_llama_cell_pass_their_flags():
    """--compile eager,compiled doubles the cells; each passes its flag (default: none, the run decides); the Llama
    cell trains scripts/pretrain_llama.sh's shape and counts SwiGLU's and grouped attention's FLOPs."""
    args = bench_gpu.parse_args(["--models", "124m,llama-1b", "--stages", "2", "--compile", "eager,compiled"])
    assert bench_gpu.cells(args) == [("124m", "bf16", 2, "eager"), ("124m", "bf16", 2, "compiled"),
                                     ("llama-1b", "bf16", 2, "eager"), ("llama-1b", "bf16", 2, "compiled")]
    flags = {mode: bench_gpu.training_flags("llama-1b", "bf16", 4, 10, "c.json", "l.jsonl", False, mode)
             for mode in bench_gpu.COMPILE_MODES}
    assert "--no-torch-compile" in flags["eager"] and "--torch-compile" in flags["compiled"]
    assert not {"--torch-compile", "--no-torch-compile"} & set(flags["default"])
    assert {"--swiglu", "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights"} <= set(flags["eager"])
    L, h, s, V, kv, f = 22, 2048, 2048, 32000, 4 * 2048 // 32, 5632
    layer = 2 * h * (h + 2 * kv) + 2 * h * h + 3 * 2 * h * f + 4 * s * h
    assert bench_gpu.flops_per_token("llama-1b") == 3 * (L * layer + 2 * h * V)
    assert bench_gpu.activation_estimate_bytes("llama-1b", 4, "bf16") is None


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is a test requirement")
def test_part_c_client_runs_on_the_cpu():
    """Part (c), tools/ds_client_check.py, as the GPU check runs it, on this CPU (the suite hides CUDA): both stages
    pass their checks and report the device, falling losses equal at ZeRO-2 and ZeRO-3, and 8 new tokens per
    prompt."""
    done = warm_python.run([sys.executable, os.path.join(REPO, "tools", "ds_client_check.py")], capture_output=True,
                           text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["stage"] for r in records] == [2, 3] and {r["device"] for r in records} == {"cpu"}
    assert records[0]["losses"] == records[1]["losses"] and len(records[0]["losses"]) == 4
    assert records[0]["losses"][-1] < records[0]["losses"][0]
    assert all(len(tokens) == 8 for r in records for tokens in r["generated"])


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


def test_targets_are_marked_met_missed_or_not_measured():
    """gpu_targets.py: the best row per target (an error row measures nothing, an fp32 or a CPU generation row
    neither); ZeRO-3 at dp 1 is the worst ZeRO-3 / ZeRO-2 pair measured alike; a target exactly at its bound is met."""
    import gpu_targets
    row = dict(ROW, precision="bf16", compile="compiled", micro_batch=16)
    training = [dict(row, model="124m", stage=2, tokens_per_s=470_000, mfu=0.3),
                dict(row, model="124m", stage=3, tokens_per_s=460_000, mfu=0.3),    # 0.979x of ZeRO-2: met
                dict(row, model="350m", stage=2, tokens_per_s=100_000, mfu=0.399),
                dict(row, model="350m", stage=3, tokens_per_s=95_000, mfu=0.38),     # 0.95x: the worst pair
                dict(row, model="350m", stage=2, precision="fp32", tokens_per_s=1, mfu=0.9),
                {"model": "1.3b", "precision": "bf16", "stage": 2, "compile": "eager", "error": "CUDA out of memory"}]
    generation = [{"batch": 1, "device": "cuda", "ours_over_hf": 3.0}, {"batch": 8, "device": "cuda", "ours_over_hf": 1.9},
                  {"batch": 32, "device": "cpu", "ours_over_hf": 9.0}]
    lines = gpu_targets.targets_table(training, generation).splitlines()
    verdicts = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[3] for line in lines[2:]}
    assert verdicts == {"GPT-2 124M tokens/s": "met", "GPT-2 350M MFU": "missed", "GPT-2 1.3B MFU": "-",
                        "Llama 1B MFU": "-", "ZeRO-3 / ZeRO-2 tokens/s at dp 1 (worst pair)": "missed",
                        "generation batch 1, ours / HF generate": "met",
                        "generation batch 8, ours / HF generate": "missed",
                        "generation batch 32, ours / HF generate": "-"}
    assert "| 470,000 | met |" in lines[2] and "| 39.9% | missed |" in lines[3] and "| 0.95x | missed |" in lines[6]
    assert "not measured | - | bench_gpu.py --models 1.3b |" in lines[4]
