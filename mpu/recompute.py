"""What the transformer recomputes in backward instead of keeping: Megatron-LM's `--recompute-granularity`,
`--recompute-method` and `--recompute-num-layers`, as one value.

    RecomputeConfig()                          nothing recomputed: every activation is kept for backward
    RecomputeConfig("selective")               each layer's attention core (QK^T, scale and mask, softmax, attention
                                               dropout, AV) runs under a checkpoint: its s x s tensors are never
                                               kept, only q, k, v (Korthikanti et al. 2022, "selective")
    RecomputeConfig("full", "uniform", 2)      the stage's layers in checkpointed groups of 2: each group keeps its
                                               input only and is recomputed whole in backward
    RecomputeConfig("full", "block", 2)        the first 2 layers of the stage checkpointed one by one, the others
                                               keep everything (no recomputation for them)

`--checkpoint-activations --checkpoint-num-layers N` is RecomputeConfig("full", "uniform", N).

The groups of one pipeline stage (`layer_chunks(layers of the stage)`), as (start, end, checkpointed), stage of 4:

    full uniform 1    (0, 1, T) (1, 2, T) (2, 3, T) (3, 4, T)
    full uniform 2    (0, 2, T) (2, 4, T)
    full uniform 3    (0, 3, T) (3, 4, T)           the last group is shorter (as --checkpoint-num-layers always was)
    full block 1      (0, 1, T) (1, 2, F) (2, 3, F) (3, 4, F)
    full block 2      (0, 1, T) (1, 2, T) (2, 3, F) (3, 4, F)
    selective, none   (0, 1, F) (1, 2, F) (2, 3, F) (3, 4, F)

Megatron-LM's rules (refused with ValueError): full needs a method and a number of layers >= 1; selective takes
neither (it applies to every layer); no granularity takes neither.
"""
from dataclasses import dataclass
from typing import Optional

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    granularity: Optional[str] = None
    """None (keep every activation), "full" (checkpoint whole layers) or "selective" (the attention core only)."""
    method: Optional[str] = None
    """full only: "uniform" (every layer, in groups of num_layers) or "block" (the first num_layers layers)."""
    num_layers: Optional[int] = None
    """full only: layers per checkpointed group (uniform) or checkpointed layers per pipeline stage (block)."""

    def __post_init__(self):
        if self.granularity not in (None,) + GRANULARITIES:
            raise ValueError(f"recompute granularity {self.granularity!r}: expected one of {GRANULARITIES} or None")
        if self.granularity != "full":
            if self.method is not None or self.num_layers is not None:
                raise ValueError(f"recompute method ({self.method}) and number of layers ({self.num_layers}) are for "
                                 f"the full granularity only, not {self.granularity}")
            return
        if self.method not in METHODS:
            raise ValueError(f"full recomputation needs a method from {METHODS}, got {self.method!r}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"full recomputation needs a number of layers >= 1, got {self.num_layers!r}")

    @classmethod
    def from_checkpoint_activations(cls, checkpoint_activations, checkpoint_num_layers=1):
        """The older switch: on = full recomputation, uniform groups of checkpoint_num_layers layers."""
        return cls("full", "uniform", checkpoint_num_layers) if checkpoint_activations else cls()

    @property
    def full(self):
        return self.granularity == "full"

    @property
    def selective(self):
        return self.granularity == "selective"

    def layer_chunks(self, num_layers):
        """[(start, end, checkpointed)] covering a stage of `num_layers` layers in order (the table above)."""
        if self.full and self.method == "uniform":
            return [(start, min(start + self.num_layers, num_layers), True)
                    for start in range(0, num_layers, self.num_layers)]
        checkpointed = self.num_layers if self.full else 0          # block: the first num_layers layers
        return [(index, index + 1, index < checkpointed) for index in range(num_layers)]

    def describe(self):
        """'none', 'selective', 'full, uniform groups of 2 layers', 'full, block of the first 1 layer': for logs."""
        layers = f"{self.num_layers} layer{'s' if self.num_layers != 1 else ''}"
        if self.full:
            return f"full, uniform groups of {layers}" if self.method == "uniform" else \
                f"full, block of the first {layers}"
        return self.granularity or "none"
