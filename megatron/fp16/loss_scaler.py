"""Loss scaling for fp16 training: one pure state machine shared by the ZeRO engine and megatron/fp16.

DeepSpeed's semantics (its `fp16` JSON block):
  - `loss_scale` > 0: a static scale; it never changes.
  - `loss_scale` == 0: dynamic. The scale starts at 2**initial_scale_power. An overflow (inf/nan in the
    gradients) skips the step; once `hysteresis` overflows have been seen since the last reset, the scale is
    divided by 2 (never below `min_loss_scale`). After `loss_scale_window` consecutive clean steps since
    the last overflow the scale is multiplied by 2 and the hysteresis budget is refilled.

Example (initial 2**4, window 2, hysteresis 2):
    update(False) -> 16, update(False) -> 32 (2 clean steps), update(True) -> 32 (hysteresis 2 -> 1),
    update(True) -> 16 (budget spent), update(False) -> 16, update(False) -> 32.
"""
from dataclasses import dataclass


@dataclass
class LossScalerConfig:
    loss_scale: float = 0.0          # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


class LossScaler:
    """`scale` multiplies the loss; `update(found_inf)` is called once per optimizer step."""

    def __init__(self, config=None):
        config = config or LossScalerConfig()
        self.dynamic = config.loss_scale == 0
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = float(config.min_loss_scale)
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = config.hysteresis

    @property
    def cur_scale(self):
        return self.scale

    def update(self, found_inf):
        """Advance one step. Returns True when the step must be skipped (an overflow was found)."""
        if self.dynamic:
            if found_inf:
                if self.hysteresis_left <= 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow_iteration = self.iteration
            elif (self.iteration - self.last_overflow_iteration) % self.window == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis
        self.iteration += 1
        return bool(found_inf)

    def state_dict(self):
        return {"scale": self.scale, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration,
                "hysteresis_left": self.hysteresis_left, "dynamic": self.dynamic}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.dynamic = bool(state["dynamic"])
