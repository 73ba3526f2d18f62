"""Hang diagnostics (DESIGN.md section 10): a breadcrumb of each rank's last collective, and SIGUSR1 stack dumps.

    with breadcrumbs.collective("reduce_losses", tensor, group):   # record, then run the collective
        dist.all_reduce(tensor, group=group)

Each wrapped collective records its name, group size, tensor shape and dtype and a per-rank sequence number before
it starts; when it raises (a gloo timeout is a RuntimeError after --distributed-timeout-minutes) the rank prints
'rank R: collective failed: <breadcrumb>: <error>' to stderr and re-raises the same exception with the breadcrumb
added as a note. `install_stack_dump()` makes `kill -USR1 <pid>` print every thread's Python stack to stderr.
"""
import contextlib
import faulthandler
import signal
import sys
import time

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
    """Remember `name` as this rank's last collective; returns the breadcrumb."""
    global _last, _count
    _count += 1
    _last = {"name": name, "group_size": _group_size(group),
             "shape": None if tensor is None else list(tensor.shape),
             "dtype": None if tensor is None else str(tensor.dtype).replace("torch.", ""),
             "sequence": _count, "started": time.time()}
    return _last


def last():
    return _last


def describe(crumb=None):
    crumb = _last if crumb is None else crumb
    if crumb is None:
        return "no collective recorded yet"
    tensor = "" if crumb["shape"] is None else f", tensor {crumb['shape']} {crumb['dtype']}"
    return (f"last collective: {crumb['name']} over {crumb['group_size']} ranks{tensor} (collective "
            f"#{crumb['sequence']} of this rank, started {time.time() - crumb['started']:.1f} s ago)")


@contextlib.contextmanager
def collective(name, tensor=None, group=None):
    """Record the breadcrumb, run the block; on an exception print the breadcrumb with it, then re-raise."""
    crumb = record(name, tensor, group)
    try:
        yield crumb
    except Exception as error:
        text = describe(crumb)
        print(f"rank {_rank()}: collective failed: {text}: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        if hasattr(error, "add_note"):
            error.add_note(f"rank {_rank()}: {text}")
        raise


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
