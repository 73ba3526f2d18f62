"""Named wall-clock timers, the one timer class of the codebase (training loop, ZeRO engine, activation
checkpointing).

    timers = Timers()
    timers("forward").start(); ...; timers("forward").stop()     # Megatron's style
    with timers("backward"): ...                                 # the same, as a block
    timers.log(["forward", "backward"], normalizer=10)           # rank 0: "time (ms) | forward: 1.23 | ..."

An enabled timer's start and stop synchronize the device first (CUDA work is asynchronous), so a phase's time is its
own; that costs a host stall per call on a GPU, so timing is asked for (the loop's --timing-log-level 1 or 2, the
engine's wall_clock_breakdown, activation checkpointing's profile). A disabled `Timers(enabled=False)` only counts
calls: no synchronization, no clock, and it reports no times (`summary()` and `log()` are empty).
"""
import time

import torch


class _Timer:
    def __init__(self, name, timers):
        self.name = name
        self._timers = timers
        self.seconds = 0.0        # accumulated since the last reset
        self.count = 0            # completed start/stop pairs since the last reset
        self.started = False
        self._start_time = 0.0

    def start(self):
        assert not self.started, f"timer {self.name} has already been started"
        if self._timers.enabled:
            self._timers.synchronize()
            self._start_time = time.perf_counter()
        self.started = True

    def stop(self):
        assert self.started, f"timer {self.name} is not started"
        if self._timers.enabled:
            self._timers.synchronize()
            self.seconds += time.perf_counter() - self._start_time
        self.count += 1
        self.started = False

    def reset(self):
        self.seconds, self.count, self.started = 0.0, 0, False

    def elapsed(self, reset=True):
        """Accumulated seconds (a running timer is included and keeps running)."""
        started = self.started
        if started:
            self.stop()
        seconds = self.seconds
        if reset:
            self.reset()
        if started:
            self.start()
        return seconds

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


class Timers:
    """`device`: the device to synchronize (default: the current CUDA device when CUDA is available)."""

    def __init__(self, enabled=True, device=None):
        self.enabled = enabled
        self.device = device
        self.timers = {}

    def __call__(self, name):
        if name not in self.timers:
            self.timers[name] = _Timer(name, self)
        return self.timers[name]

    def synchronize(self):
        synchronize(self.device)

    def reset(self):
        for timer in self.timers.values():
            timer.reset()

    def summary(self):
        """{name: {"count": completed pairs, "seconds": accumulated}} since the last reset ({} when disabled)."""
        if not self.enabled:
            return {}
        return {name: {"count": t.count, "seconds": t.seconds} for name, t in self.timers.items()}

    def mean_ms_text(self, reset=True):
        """' | forward 1.23 ms | ...': mean milliseconds per call of every timer that ran."""
        text = "".join(f" | {name} {1000 * t.seconds / t.count:.2f} ms" for name, t in self.timers.items() if t.count)
        if reset:
            self.reset()
        return text

    def log(self, names, normalizer=1.0, reset=True):
        """Print 'time (ms) | name: ms / normalizer | ...' on rank 0."""
        parts = [f"{name}: {self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer:.2f}"
                 for name in names if name in self.timers and self.enabled]
        if parts and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print("time (ms) | " + " | ".join(parts), flush=True)


def synchronize(device=None):
    """Wait for `device`'s queued work (None: the current CUDA device when CUDA is available); the CPU has none."""
    if device is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    elif torch.cuda.is_available():
        torch.cuda.synchronize()
