"""When training stops early, decided identically on every rank (--exit-interval, --exit-duration-in-mins,
--exit-signal-handler)."""
import signal
import time

import torch
import torch.distributed as dist

import mpu
from megatron.guards import breadcrumbs


class ExitController:
    """Decides, identically on every rank, when training stops early: --exit-interval, --exit-duration-in-mins, or
    (--exit-signal-handler) a SIGTERM received by any rank. The time and signal flags are combined with one
    all-reduce (MAX) per step, so all ranks stop after the same iteration even when only one was signalled.
    Call close() after training to restore the previous SIGTERM handler."""

    def __init__(self, exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False):
        self.exit_interval = exit_interval
        self.exit_duration_secs = None if exit_duration_in_mins is None else exit_duration_in_mins * 60
        self.start_time = time.time()
        self.reason = None
        self.signal_received = False
        # A flag of its own: signal.signal() returns None for a handler installed outside Python, so "previous
        # handler is None" cannot mean "no handler installed" (a rank that thought so would skip the all-reduce).
        self.handles_signal = bool(exit_signal_handler)
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if self.handles_signal else None

    def _on_sigterm(self, signum, frame):
        self.signal_received = True

    def close(self):
        if self.handles_signal:
            previous = self._previous_handler
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self.handles_signal, self._previous_handler = False, None

    def should_exit(self, iteration):
        if self.exit_interval and iteration % self.exit_interval == 0:
            self.reason = f"--exit-interval {self.exit_interval}"
            return True
        if self.exit_duration_secs is None and not self.handles_signal:
            return False
        time_up = self.exit_duration_secs is not None and time.time() - self.start_time > self.exit_duration_secs
        flags = torch.tensor([float(time_up), float(self.signal_received)], device=mpu.get_device())
        breadcrumbs.all_reduce(flags, "exit controller (time, signal) flags", op=dist.ReduceOp.MAX)
        if flags[1].item():
            self.reason = "SIGTERM (--exit-signal-handler)"
            return True
        if flags[0].item():
            self.reason = "--exit-duration-in-mins"
            return True
        return False
