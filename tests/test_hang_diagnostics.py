"""Hang diagnostics: SIGUSR1 dumps every thread's stack on every rank; a collective that one rank never joins ends
(after --distributed-timeout-minutes; 15 s here, so start-up skew between the ranks cannot trip it first) with the
waiting rank's breadcrumb of its last collective."""
import os
import signal
import subprocess
import sys
import time

from megatron.spawn import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--make-vocab-size-divisible-by", "8", "--train-iters", "2", "--eval-iters", "0"]


def _torchrun(script, tmp_path, extra=()):
    path = tmp_path / "job.py"
    path.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\n" + script)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(path)] + TINY + list(extra),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SLEEPER = """
import os, time
from megatron.initialize import initialize_megatron
args = initialize_megatron()
ready = os.path.join(os.environ["DONE_FILE"] + ".pids", str(args.rank))   # a file each: ranks share stdout
with open(ready + ".tmp", "w") as handle:
    handle.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)

def waiting_for_the_test(done):
    while not os.path.exists(done):
        time.sleep(0.05)

waiting_for_the_test(os.environ["DONE_FILE"])
"""


def test_sigusr1_dumps_every_ranks_stack(tmp_path):
    done = tmp_path / "done"
    pid_dir = tmp_path / "done.pids"
    pid_dir.mkdir()
    os.environ["DONE_FILE"] = str(done)
    try:
        job = _torchrun(SLEEPER, tmp_path)
    finally:
        del os.environ["DONE_FILE"]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
            assert job.poll() is None, "the job ended before both ranks were ready"
            time.sleep(0.05)
        pids = [int((pid_dir / name).read_text()) for name in sorted(os.listdir(pid_dir)) if name.isdigit()]
        assert len(pids) == 2, f"ranks ready: {pids}"
        for pid in pids:   # one at a time: both ranks write to the same stderr
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
        done.write_text("")
        _, stderr = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    assert stderr.count("in waiting_for_the_test") == 2, stderr[-3000:]     # one stack per rank
    assert stderr.count("most recent call first") >= 2, stderr[-3000:]


NEVER_JOINS = """
import time
import torch
from megatron.initialize import initialize_megatron
from megatron.utils import reduce_losses
args = initialize_megatron()
if args.rank == 0:
    reduce_losses([torch.tensor(1.0)])       # rank 1 never joins
else:
    time.sleep(40)
"""


def test_unjoined_collective_times_out_with_breadcrumb(tmp_path):
    start = time.monotonic()
    job = _torchrun(NEVER_JOINS, tmp_path, ["--distributed-timeout-minutes", "0.25"])
    try:
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert time.monotonic() - start < 45
    assert ("rank 0: collective failed: last collective: reduce_losses over 2 ranks, tensor [1] float32"
            in stderr), stderr[-3000:]


def _breadcrumb_on_timeout():
    """Rank 0 all-reduces on a group with a 2 s timeout that rank 1 never uses."""
    import contextlib
    import io
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from megatron import breadcrumbs
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(4)
        return None
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            breadcrumbs.all_reduce(torch.zeros(3, 2), "test collective", group=group)
    except RuntimeError as error:
        return captured.getvalue(), getattr(error, "__notes__", []), breadcrumbs.last()["name"]
    return "did not time out"


def test_breadcrumb_helper_prints_and_notes_the_last_collective():
    printed, notes, name = run_distributed(_breadcrumb_on_timeout, 2)[0]
    expected = "last collective: test collective over 2 ranks, tensor [3, 2] float32 (collective #"
    assert printed.startswith("rank 0: collective failed: " + expected), printed
    assert any(expected in note for note in notes), notes
    assert name == "test collective"


def _stuck_in_a_collective(seconds):
    time.sleep(seconds)


def test_slow_step_prints_breadcrumb_and_stacks_once():
    import io
    import torch
    from megatron import breadcrumbs
    stream = io.StringIO()
    watchdog = breadcrumbs.SlowStepWatchdog(factor=5, min_seconds=0.0, min_history=3, poll_seconds=0.01,
                                            stream=stream)
    try:
        for iteration in range(1, 4):            # the median: ~20 ms
            with watchdog.step(iteration):
                time.sleep(0.02)
        assert stream.getvalue() == ""
        breadcrumbs.record("test all-reduce", torch.zeros(4, 2))
        with watchdog.step(4):                   # 20x the median: reported while it runs, once
            _stuck_in_a_collective(0.4)
        with watchdog.step(5):
            time.sleep(0.02)
    finally:
        watchdog.close()
    report = stream.getvalue()
    assert report.count("rank 0: step 4 has run") == 1 and "step 5" not in report, report
    assert "the median step (0.02" in report
    assert "last collective: test all-reduce over 1 ranks, tensor [4, 2] float32" in report
    assert "in _stuck_in_a_collective" in report and "Thread MainThread" in report   # where the main thread waits
    assert watchdog.threshold() == 5 * sorted(watchdog.durations)[2]


def test_no_watchdog_thread_when_off():
    import threading
    from megatron import breadcrumbs
    before = threading.active_count()
    breadcrumbs.SlowStepWatchdog(factor=0).close()
    assert threading.active_count() == before


def _engine_and_mpu_breadcrumbs():
    import torch
    import mpu
    from megatron import breadcrumbs, zero
    from tests.zero_helpers import TinyNet, batch, ds_config, param_groups
    breadcrumbs.install_collective_breadcrumbs()
    seen = []
    mpu.broadcast_data(["text"], {"text": torch.zeros(2, 3, dtype=torch.int64)}, torch.int64)
    seen.append(breadcrumbs.describe())
    model = TinyNet()
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=ds_config(3, micro=2), mpu=mpu, dist_init_required=False)
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    seen.append(breadcrumbs.describe())
    with breadcrumbs.collective("a named one"):
        torch.distributed.barrier()
    seen.append(breadcrumbs.describe())
    return seen


def test_collectives_inside_mpu_and_the_engine_leave_breadcrumbs():
    """mpu imports only torch and the engine calls torch.distributed directly: the process-wide wrapper still
    names their collectives (function, file and line); a named breadcrumb is not overwritten by its own call."""
    seen = run_distributed(_engine_and_mpu_breadcrumbs, 2, model_parallel_size=1)[0]
    assert seen[0].startswith("last collective: broadcast from mpu/data.py:"), seen
    assert seen[1].startswith("last collective: reduce from zero/bucketing.py:"), seen   # a gradient bucket
    assert seen[2].startswith("last collective: a named one over 2 ranks"), seen
