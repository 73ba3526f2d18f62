"""`engine.tput_timer`: DeepSpeed's ThroughputTimer (deepspeed.utils.timer, 0.19.8), its counters and its average.

DeepSpeed-Chat calls `engine.tput_timer.update_epoch_count()` after each epoch; the engine itself calls start() at
each forward and stop(global_step=<accumulation boundary>) at each step(). The first `start_step` (2) optimizer
steps are not timed (warm-up), so with a global batch of B samples and T seconds over the timed steps:

    forward/step x 4 (accumulation 1)  ->  global_step_count 4, micro_step_count 4,
                                           avg_samples_per_sec() = B / (T / (4 - 2))

DeepSpeed also logs a line every steps_per_print steps; this engine's own progress line (engine.py) serves there.
Where DeepSpeed's data loader starts the timer (its iterator, so loading is timed too), this engine's forward does.

The config's "timers": {"throughput": {"enabled", "synchronized"}} are DeepSpeed's keys. `synchronized` waits for
the device at each timed start and stop (two host stalls per micro-step): DeepSpeed does it by default, this
engine only when asked (that key, or wall_clock_breakdown); unsynchronized, a step's time is its launch time until
the queue fills, which over many steps is the compute time.
"""
import time

from megatron.timers import synchronize


class ThroughputTimer:
    """Samples per second over the optimizer steps after the first `start_step` (DeepSpeed's names and rules)."""

    def __init__(self, batch_size, start_step=2, enabled=True, synchronized=False, device=None):
        """`enabled` False: start() and stop() do nothing (DeepSpeed's rule); `synchronized`: wait for `device`
        at each timed start and stop."""
        self.enabled, self.synchronized, self.device = enabled, synchronized, device
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0      # since the last update_epoch_count()
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.start_time = 0.0
        self.started = False

    def update_epoch_count(self):
        """A new epoch: count it and restart the micro-step count (DeepSpeed-Chat calls it after each epoch)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self):
        """Start timing a micro-step; the clock runs only once `start_step` optimizer steps are done (warm-up)."""
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self._synchronize()
            self.start_time = time.time()

    def stop(self, global_step=False):
        """End the micro-step started last (nothing when none was started); `global_step`: it ended an optimizer
        step (the accumulation boundary)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(global_step)
        if self.start_time > 0:
            self._synchronize()
            self.total_elapsed_time += time.time() - self.start_time

    def avg_samples_per_sec(self):
        """Global-batch samples per second over the timed steps; -inf before the first step (as DeepSpeed)."""
        if self.global_step_count == 0:
            return float("-inf")
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time == 0:
            return float("-inf")     # DeepSpeed divides by zero here (ZeroDivisionError); nothing timed yet
        return self.batch_size / (self.total_elapsed_time / timed_steps)

    def _synchronize(self):
        if self.synchronized:
            synchronize(self.device)
