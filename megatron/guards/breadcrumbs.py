"""Hang diagnostics (DESIGN.md section 10): a breadcrumb of each rank's last collective, a report when one times
out, and SIGUSR1 stack dumps.

    with breadcrumbs.collective("reduce_losses", tensor, group):   # record, then run the collective
        dist.all_reduce(tensor, group=group)

Each collective records a breadcrumb before it starts: its name, group, tensor shape and dtype, its caller (the
first frame outside torch and this module) and a per-rank sequence number. `install_collective_breadcrumbs()`,
called at initialization, makes every torch.distributed collective of the process leave one too (the ZeRO engine's
buckets and gathers, mpu's mappings, pipeline sends and receives), and wraps the Work an async collective returns
so that its wait() is reported with the breadcrumb of the collective that launched it. When a collective times out
(a gloo timeout is a RuntimeError after --distributed-timeout-minutes) the waiting rank prints

    rank 0: collective timed out after 15.0 s: reduce over ranks [0, 1] called from megatron/zero/bucketing.py:37
    (collective #12); stacks follow

(one line) and every thread's stack, then re-raises (the process exits non-zero); any other failure prints
'rank R: collective failed: <breadcrumb>: <error>'. Either way the exception gets the breadcrumb as a note.
`install_stack_dump()` makes `kill -USR1 <pid>` print every thread's Python stack to stderr.
`SlowStepWatchdog` prints the breadcrumb and every thread's stack once when a training step runs far longer than
the median of the recent ones (a rank stuck in a collective says where long before the timeout).
"""
import contextlib
import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
import traceback

_last = None      # the breadcrumb of this rank's last collective (a dict), None before the first
_count = 0


def _rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_size(group):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def record(name, tensor=None, group=None):
    """Remember `name` as this rank's last collective (called from the caller's frame); returns the breadcrumb."""
    global _last, _count
    _count += 1
    _last = {"name": name, "group_size": _group_size(group), "group": group, "caller": _caller(),
             "shape": None if tensor is None else list(tensor.shape),
             "dtype": None if tensor is None else str(tensor.dtype).replace("torch.", ""),
             "sequence": _count, "started": time.time()}
    return _last


def last():
    return _last


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SKIPPED = None   # the files whose frames are not a collective's caller: torch's, this module's, contextlib's


def _caller(also_skipped=()):
    """'file:line (function)' of the first frame outside torch, this module, contextlib and the files
    `also_skipped` (repo-relative)."""
    global _SKIPPED
    if _SKIPPED is None:
        import torch
        _SKIPPED = (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(__file__), contextlib.__file__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED + tuple(also_skipped)):
        frame = frame.f_back
    if frame is None:
        return "unknown"
    path = frame.f_code.co_filename
    if path.startswith(_REPO + os.sep):
        path = path[len(_REPO) + 1:]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _ranks(crumb):
    """The global ranks of the breadcrumb's group, as text ('[0, 1]'; long lists shortened)."""
    import torch.distributed as dist
    try:
        ranks = dist.get_process_group_ranks(crumb["group"] or dist.GroupMember.WORLD)
    except Exception:   # no process group (a single process), or one already destroyed
        return f"{crumb['group_size']} ranks"
    if len(ranks) > 16:
        return f"[{', '.join(map(str, ranks[:8]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"
    return str(list(ranks))


def describe(crumb=None):
    crumb = _last if crumb is None else crumb
    if crumb is None:
        return "no collective recorded yet"
    tensor = "" if crumb["shape"] is None else f", tensor {crumb['shape']} {crumb['dtype']}"
    return (f"last collective: {crumb['name']} over {crumb['group_size']} ranks{tensor}, called from "
            f"{crumb['caller']} (collective #{crumb['sequence']} of this rank, started "
            f"{time.time() - crumb['started']:.1f} s ago)")


def _is_timeout(error):
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def report_failure(crumb, error):
    """Print (once per exception) why the collective of `crumb` failed: a timeout gets one line naming the
    collective, its group and caller, then every thread's stack; anything else the 'collective failed' line.
    Adds the breadcrumb to the exception as a note."""
    if getattr(error, "_breadcrumb_reported", False):
        return
    try:
        error._breadcrumb_reported = True
    except AttributeError:
        pass
    rank = _rank()
    if _is_timeout(error):
        print(f"rank {rank}: collective timed out after {time.time() - crumb['started']:.1f} s: {crumb['name']} "
              f"over ranks {_ranks(crumb)} called from {crumb['caller'].rsplit(' (', 1)[0]} (collective "
              f"#{crumb['sequence']}); stacks follow", file=sys.stderr, flush=True)
        dump_all_stacks(sys.stderr)
    else:
        print(f"rank {rank}: collective failed: {describe(crumb)}: {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)
    if hasattr(error, "add_note"):
        error.add_note(f"rank {rank}: {describe(crumb)}")


def dump_all_stacks(stream):
    """Every thread's Python stack on `stream`: faulthandler's dump where it has a file descriptor (it works
    even with the interpreter stuck), else the same as text."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):   # a test's captured stderr
        stream.write(format_all_stacks() + "\n")
        stream.flush()
        return
    stream.flush()
    faulthandler.dump_traceback(file=descriptor, all_threads=True)


_named = 0        # > 0 inside collective(): its descriptive name is kept over the generic one of the call


@contextlib.contextmanager
def collective(name, tensor=None, group=None):
    """Record the breadcrumb, run the block; on an exception print the breadcrumb with it, then re-raise."""
    global _named
    crumb = record(name, tensor, group)
    _named += 1
    try:
        yield crumb
    except Exception as error:
        report_failure(crumb, error)
        raise
    finally:
        _named -= 1


# torch.distributed's collectives that every caller (the ZeRO engine, mpu, the loop) reaches through `dist.<name>`
# (not isend/irecv: P2POp and batch_isend_irecv tell them apart by identity; batch_isend_irecv records the batch
# and its returned Works report the timeout)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier", "all_to_all", "all_to_all_single", "send", "recv",
               "batch_isend_irecv", "all_gather_object", "broadcast_object_list")


def install_collective_breadcrumbs():
    """Wrap torch.distributed's collectives once, process-wide, so that every call (the ZeRO engine's buckets and
    gathers, mpu's mappings, pipeline sends) leaves a breadcrumb naming the function and its caller, and a failure
    or timeout (in the call, or in the wait() of the Work an async call returns) is reported with it; mpu stays
    free of megatron imports. Returns the names wrapped (empty when already installed)."""
    import torch.distributed as dist
    wrapped = []
    for name in COLLECTIVES:
        function = getattr(dist, name, None)
        if function is None or getattr(function, "_breadcrumb", False):
            continue
        setattr(dist, name, _recording(name, function))
        wrapped.append(name)
    return wrapped


def _recording(name, function):
    import functools
    import torch.distributed as dist

    @functools.wraps(function)
    def call(*args, **kwargs):
        if _named:
            crumb = _last
        elif name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            peers = ", ".join(f"{op.op.__name__} {'from' if 'recv' in op.op.__name__ else 'to'} {op.peer}"
                              for op in ops)
            crumb = record(f"batch_isend_irecv [{peers}]", ops[0].tensor if ops else None,
                           ops[0].group if ops else None)
        else:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            tensor = next((a for a in args if hasattr(a, "shape") and hasattr(a, "dtype")), None)
            crumb = record(name, tensor, group)
        try:
            result = function(*args, **kwargs)
        except Exception as error:
            report_failure(crumb, error)
            raise
        if isinstance(result, dist.Work):
            return _ReportingWork(result, crumb)
        if isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
            return [_ReportingWork(work, crumb) for work in result]
        return result
    call._breadcrumb = True
    return call


class _ReportingWork:
    """The Work of an async collective whose wait() reports a failure (a timeout surfaces here) with the breadcrumb
    of the collective that launched it; everything else goes to the Work itself."""

    def __init__(self, work, crumb):
        self._work, self._crumb = work, crumb

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as error:
            report_failure(self._crumb, error)
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)


def all_reduce(tensor, name, group=None, **kwargs):
    import torch.distributed as dist
    with collective(name, tensor, group):
        return dist.all_reduce(tensor, group=group, **kwargs)


def install_stack_dump():
    """`kill -USR1 <pid>` dumps every thread's Python stack to stderr (the process keeps running)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):   # a test's captured stderr may have no file descriptor
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
        return


def format_all_stacks():
    """Every thread's Python stack, most recent call last (what faulthandler prints, as text for any stream)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class SlowStepWatchdog:
    """A daemon thread that reports (once per step) a step that has run longer than max(factor x the median of the
    last `history` steps, min_seconds), after at least `min_history` steps: the rank, the step, how long, its
    breadcrumb and every thread's stack. The report must come from another thread: a rank stuck in a collective
    never returns to say so. factor 0: off (no thread).

        watchdog = SlowStepWatchdog(factor=10)
        with watchdog.step(iteration):
            train_step(...)
    """

    def __init__(self, factor, min_seconds=30.0, min_history=5, history=100, poll_seconds=0.1, stream=None):
        self.factor, self.min_seconds, self.min_history = float(factor), float(min_seconds), int(min_history)
        self.durations, self.history, self.poll_seconds = [], int(history), float(poll_seconds)
        self.stream = stream
        self._lock = threading.Lock()
        self._current = None          # (iteration, start time) of the running step, None between steps
        self._stop = threading.Event()
        self._thread = None
        if self.factor > 0:
            self._thread = threading.Thread(target=self._watch, name="slow-step-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def step(self, iteration):
        with self._lock:
            self._current = (iteration, time.monotonic(), False)
        try:
            yield
        finally:
            with self._lock:
                _, started, _ = self._current
                self._current = None
            self.durations = (self.durations + [time.monotonic() - started])[-self.history:]

    def threshold(self):
        """Seconds after which the running step is reported; None before min_history steps."""
        if len(self.durations) < self.min_history:
            return None
        return max(self.factor * statistics.median(self.durations), self.min_seconds)

    def _watch(self):
        while not self._stop.wait(self.poll_seconds):
            limit = self.threshold()
            with self._lock:
                if limit is None or self._current is None or self._current[2]:
                    continue
                iteration, started, _ = self._current
                elapsed = time.monotonic() - started
                if elapsed <= limit:
                    continue
                self._current = (iteration, started, True)   # once per step
            self._report(iteration, elapsed)

    def _report(self, iteration, elapsed):
        median = statistics.median(self.durations)
        stream = self.stream or sys.stderr
        print(f"rank {_rank()}: step {iteration} has run {elapsed:.1f} s, {elapsed / median:.0f}x the median step "
              f"({median:.3f} s); {describe()}\n{format_all_stacks()}", file=stream, flush=True)

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
