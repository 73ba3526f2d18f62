"""Hang diagnostics: SIGUSR1 dumps every thread's stack on every rank; a collective that one rank never joins ends
(after --distributed-timeout-minutes; 15 s here, so start-up skew between the ranks cannot trip it first; or after a
few seconds' process-group timeout set once both ranks are in step) with one line on the waiting rank naming the
collective, its group and its caller, then every thread's stack, and a non-zero exit."""
import os
import re
import signal
import subprocess
import statistics
import sys
import time

from megatron.spawn import free_port, run_distributed

from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE
from tests import warm_python


TINY = MOCK_VOCAB + TINY_SHAPE + ["--train-iters", "2", "--eval-iters", "0"]


def _torchrun(script, tmp_path, extra=()):
    path = tmp_path / "job.py"
    path.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\n" + script)
    return warm_python.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
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


def _ready_ranks(pid_dir):
    return sorted(name for name in os.listdir(pid_dir) if name.isdigit())


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
        while len(_ready_ranks(pid_dir)) < 2 and time.monotonic() < deadline:   # not a rank's "<rank>.tmp"
            assert job.poll() is None, "the job ended before both ranks were ready"
            time.sleep(0.05)
        pids = [int((pid_dir / name).read_text()) for name in _ready_ranks(pid_dir)]
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
    time.sleep(300)      # far past the test's wait: only rank 0's timeout can end the job in time
"""


def test_unjoined_collective_times_out_with_breadcrumb(tmp_path):
    job = _torchrun(NEVER_JOINS, tmp_path, ["--distributed-timeout-minutes", "0.25"])
    try:   # without the 15 s timeout rank 0 waits for rank 1's 300 s sleep: TimeoutExpired (no wall-clock bound
        _, stderr = job.communicate(timeout=200)   # here: the job's start-up alone took 50 s on a loaded machine)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    _assert_reported(stderr, 0, "reduce_losses", "[0, 1]", _line_of("megatron/utils.py", '"reduce_losses", group'),
                     "reduce_losses", timeout=15.0)
    assert "rank 0: last collective: reduce_losses over 2 ranks, tensor [1] float32, called from megatron/utils.py:" \
        in stderr, stderr[-3000:]       # the exception's note


def _breadcrumb_on_timeout():
    """Rank 0 all-reduces on a group with a 2 s timeout that rank 1 never uses."""
    import contextlib
    import io
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from megatron.guards import breadcrumbs
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(4)
        return None
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            breadcrumbs.all_reduce(torch.zeros(3, 2), "test collective", group=group)   # HELPER CALL
    except RuntimeError as error:
        return captured.getvalue(), getattr(error, "__notes__", []), breadcrumbs.last()["name"]
    return "did not time out"


def test_breadcrumb_helper_prints_and_notes_the_last_collective():
    """A stream without a file descriptor (captured stderr) gets the stacks as text."""
    printed, notes, name = run_distributed(_breadcrumb_on_timeout, 2)[0]
    caller = _line_of("tests/training/test_hang_diagnostics.py", "# HELPER" + " CALL")
    assert re.match(rf"rank 0: collective timed out after [23]\.\d s: test collective over ranks \[0, 1\] called from "
                    rf"{caller} \(collective #1\); stacks follow\nThread MainThread \(most recent call last\):\n",
                    printed), printed
    assert "in _breadcrumb_on_timeout\n" in printed, printed
    expected = (f"last collective: test collective over 2 ranks, tensor [3, 2] float32, called from {caller} "
                "(_breadcrumb_on_timeout) (collective #1")
    assert any(expected in note for note in notes), notes
    assert name == "test collective"


def _stuck_in_a_collective(seconds):
    time.sleep(seconds)


def test_slow_step_prints_breadcrumb_and_stacks_once():
    import io
    import torch
    from megatron.guards import breadcrumbs
    stream = io.StringIO()
    watchdog = breadcrumbs.SlowStepWatchdog(factor=5, min_seconds=0.0, min_history=3, poll_seconds=0.01,
                                            stream=stream)
    try:
        for iteration, seconds in enumerate((0.01, 0.02, 0.06), 1):   # the median ~20 ms (mean 30, max 60)
            with watchdog.step(iteration):
                time.sleep(seconds)
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
    # the median of the first three steps (the sleeps take longer than 20 ms on a loaded machine)
    assert f"the median step ({statistics.median(watchdog.durations[:3]):.3f} s)" in report, report
    assert "last collective: test all-reduce over 1 ranks, tensor [4, 2] float32" in report
    assert "in _stuck_in_a_collective" in report and "Thread MainThread" in report   # where the main thread waits
    assert watchdog.threshold() == 5 * sorted(watchdog.durations)[2]


def test_no_watchdog_thread_when_off():
    import threading
    from megatron.guards import breadcrumbs
    before = threading.active_count()
    breadcrumbs.SlowStepWatchdog(factor=0).close()
    assert threading.active_count() == before


def _engine_and_mpu_breadcrumbs():
    import contextlib
    import io
    import torch
    import mpu
    from megatron.guards import breadcrumbs
    from megatron import zero
    from tests.helpers import TinyNet, batch, ds_config, param_groups
    breadcrumbs.install_collective_breadcrumbs()
    seen = []
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    mpu.clip_grad_norm([weight], 1.0)
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
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    default_hooks._allreduce_fut(None, torch.ones(2)).wait()     # torch's DDP hook calls dist.all_reduce (async)
    seen.append(breadcrumbs.describe())
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        try:
            torch.distributed.broadcast(torch.zeros(2), src=5)     # not a timeout: the 'failed' line, no stacks
        except (RuntimeError, ValueError) as error:
            seen.append((captured.getvalue(), type(error).__name__, str(error)))
    return seen


def test_collectives_inside_mpu_and_the_engine_leave_breadcrumbs():
    """mpu imports only torch and the engine calls torch.distributed directly: the process-wide wrapper still
    names their collectives (function, file and line of the first frame outside torch); a named breadcrumb is not
    overwritten by its own call; a failure that is not a timeout prints the 'collective failed' line, no stacks."""
    seen = run_distributed(_engine_and_mpu_breadcrumbs, 2, model_parallel_size=1)[0]
    assert seen[0].startswith("last collective: all_reduce over 1 ranks, tensor [1] float32, called from "
                              "mpu/grads.py:"), seen
    bucket = _line_of("megatron/zero/bucketing.py", "dist.reduce(buffer[")
    assert seen[1].startswith("last collective: reduce over 2 ranks, tensor ["), seen     # a gradient bucket
    assert f", called from {bucket} (reduce_range) (collective #" in seen[1], seen
    assert seen[2].startswith("last collective: a named one over 2 ranks, called from tests/training/test_hang_diag"), seen
    # the caller is the first frame outside torch: this worker, not torch's default_hooks.py
    hook = _line_of("tests/training/test_hang_diagnostics.py", "default_hooks." + "_allreduce_fut(None")
    assert seen[3].startswith(f"last collective: all_reduce over 2 ranks, tensor [2] float32, called from {hook} "
                              "(_engine_and_mpu_breadcrumbs)"), seen
    printed, kind, message = seen[4]
    caller = _line_of("tests/training/test_hang_diagnostics.py", "src=" + "5)")
    assert printed.startswith(f"rank 0: collective failed: last collective: broadcast over 2 ranks, tensor [2] "
                              f"float32, called from {caller} (_engine_and_mpu_breadcrumbs) (collective #"), printed
    assert printed.endswith(f"s ago): {kind}: {message}\n") and "most recent call" not in printed, printed


STALLED = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import mpu
from megatron.guards import breadcrumbs
breadcrumbs.install_collective_breadcrumbs()            # as initialize_megatron does
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, mode, timeout = dist.get_rank(), os.environ["STALL_MODE"], float(os.environ["STALL_TIMEOUT"])


def stalled(seconds=120):
    time.sleep(seconds)


def started():                                         # both ranks here together, then the hang begins
    dist.barrier()
    if rank == 0:
        with open(os.environ["STALL_STARTED"], "w") as handle:
            handle.write(repr(time.time()))


if mode == "zero":
    from megatron import zero
    from megatron.zero import bucketing
    from tests.helpers import TinyNet, batch, ds_config, param_groups
    mpu.initialize_model_parallel(1, timeout=timedelta(seconds=timeout))
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model))  # its first use imports torch._dynamo: a cold .pyc cache
    optimizer.step()                                    # or a loaded machine can skew the ranks by seconds there
    dist.barrier()                                     # in step before the engine's first collective (4 s timeout)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(2, micro=2, overlap_comm=True), mpu=mpu,
                                      dist_init_required=False)
    if rank == 1:                                      # rank 1 stalls inside a gradient bucket's reduction
        reduce_range = bucketing.reduce_range
        bucketing.reduce_range = lambda *args, **kwargs: stalled() or reduce_range(*args, **kwargs)

    def train_one_step():
        x, y = batch(0, 4)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()

    started()
    train_one_step()
else:                                                  # the last stage waits for activations that never come
    from megatron.pipeline import p2p_communication
    mpu.initialize_model_parallel(1, 2, timeout=timedelta(seconds=timeout))
    spec = p2p_communication.TensorSpec((2, 4, 8), torch.float32, torch.device("cpu"))

    def receive_activations():
        return p2p_communication.recv_forward(spec)

    sent = torch.arange(64, dtype=torch.float32).view(spec.shape)   # one exchange that works, through the wrapper
    if rank == 0:
        p2p_communication.send_forward(sent, spec)
    else:
        assert torch.equal(receive_activations(), sent)
    started()
    if rank == 0:
        stalled()
    else:
        receive_activations()
"""
STALL_TIMEOUT = 4.0     # seconds: the process-group timeout of mpu's groups


def _line_of(path, text):
    """'path:line' of the one line of the repository file `path` that contains `text` (where the collective is
    launched: the caller a report must name)."""
    lines = [i for i, line in enumerate(open(os.path.join(REPO, path)), 1) if text in line]
    assert len(lines) == 1, (path, text, lines)
    return f"{path}:{lines[0]}"


def _stalled_job(tmp_path, mode):
    """Run STALLED under torchrun; returns (exit code, stderr, seconds from the hang's start to the job's exit)."""
    started = tmp_path / "started"
    os.environ.update(STALL_MODE=mode, STALL_TIMEOUT=str(STALL_TIMEOUT), STALL_STARTED=str(started))
    try:
        job = _torchrun(STALLED, tmp_path)
    finally:
        for key in ("STALL_MODE", "STALL_TIMEOUT", "STALL_STARTED"):
            del os.environ[key]
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    ended = time.time()
    assert started.exists(), stderr[-3000:]
    return job.returncode, stderr, ended - float(started.read_text())


def _assert_reported(stderr, rank, collective, ranks, caller, waiting_in, timeout=STALL_TIMEOUT):
    """One line naming the collective, its group and its caller, then every thread's stack (faulthandler's),
    whose main thread is where the rank waits."""
    pattern = (rf"rank {rank}: collective timed out after (\d+\.\d) s: {re.escape(collective)} over ranks "
               rf"{re.escape(ranks)} called from {re.escape(caller)} \(collective #\d+\); stacks follow\n")
    found = re.search(pattern, stderr)
    assert found, stderr[-4000:]
    assert timeout - 0.5 <= float(found.group(1)) <= timeout + 10, found.group(0)
    stacks = stderr[found.end():]
    assert re.match(r"(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n", stacks), stacks[:500]
    waiting = re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n((?:  File .*\n)+)", stacks)
    assert waiting and f" in {waiting_in}\n" in waiting.group(1), stacks[:3000]


def test_rank_stalled_inside_the_zero_engine_is_reported_by_the_waiting_rank(tmp_path):
    """Rank 1 sleeps inside a ZeRO-2 gradient bucket's reduction (overlap_comm: the reduce is async, its wait()
    times out): rank 0 names the bucket's reduce, its caller in bucketing.py and the group, dumps its stacks and
    the job exits non-zero within the timeout plus a margin."""
    code, stderr, seconds = _stalled_job(tmp_path, "zero")
    assert code != 0, stderr[-3000:]
    _assert_reported(stderr, 0, "reduce", "[0, 1]", _line_of("megatron/zero/bucketing.py", "dist.reduce(buffer["),
                     "train_one_step")
    assert seconds < STALL_TIMEOUT + 20, seconds
    print(f"zero stall: exit {seconds:.1f} s after the hang began (timeout {STALL_TIMEOUT} s)")


def test_rank_stalled_before_a_pipeline_send_is_reported_by_the_receiving_stage(tmp_path):
    """Stage 0 never sends: stage 1's receive (batch_isend_irecv, Work.wait) names the receive, its peer and caller
    in p2p_communication.py and the pipeline group, dumps its stacks, and the job exits non-zero in time."""
    code, stderr, seconds = _stalled_job(tmp_path, "pipeline")
    assert code != 0, stderr[-3000:]
    _assert_reported(stderr, 1, "batch_isend_irecv [irecv from 0]", "[0, 1]",
                     _line_of("megatron/pipeline/p2p_communication.py", "dist.batch_isend_irecv(ops)"), "receive_activations")
    assert seconds < STALL_TIMEOUT + 20, seconds
    print(f"pipeline stall: exit {seconds:.1f} s after the hang began (timeout {STALL_TIMEOUT} s)")
