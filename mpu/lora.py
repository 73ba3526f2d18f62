"""LoRA (Hu et al. 2021) on the column- and row-parallel linears, with PEFT's semantics, split along each layer's
parallel dimension so that a LoRA model is the same at any model-parallel size:

    y = W x + b + (alpha / r) B A dropout(x)        A [r, in], B [out, r]; W, b (and every other weight) frozen

    ColumnParallelLinear (W split by output rows): A whole on every rank, B split by rows as W is (the fused
        q/k/v stride too). Rank i computes y_i = W_i x + b_i + s B_i u with u = A x' on every rank, where x is the
        input *before* the layer's copy_to_model_parallel_region and u passes through a copy of its own: that
        copy's backward sums dL/du = s sum_i B_i^T g_i over the ranks, so A's gradient (dL/du x'^T) and this
        path's input gradient (A^T dL/du) are whole and equal on every rank. (A's gradient from B_i^T g_i alone
        would be rank i's part of the sum.)
    RowParallelLinear (W split by input columns, x = [x_1 ... x_p]): A split by columns as W is, B whole on every
        rank. u = sum_i A_i x'_i (reduce_from_model_parallel_region, an all-reduce of [..., r]), then
        y = sum_i W_i x_i + b + s B u; B's gradient s g u^T is whole on every rank (like the bias).

    Example, q/k/v (stride 3) at model-parallel size 2, h = 2: the full B [3h, r] has rows q0 q1 k0 k1 v0 v1;
    rank 0 holds [q0, k0, v0] and rank 1 [q1, k1, v1], the rows of its slice of W.

Initialization (PEFT's default): A kaiming-uniform(a=sqrt(5)) over the full [r, in] (bound 1/sqrt(in)), B zeros.
`add_lora` draws the full-size masters from the default generator after the model's own weights, every layer's in
layer order on every pipeline stage (a stage keeps its layers' pieces), and splits them: the base weights are those
of the same model without LoRA, and the adapters are the same at any model-parallel and pipeline size.
Dropout on the adapter's input uses one mask over the full input width from the default generator (layers.py).

`adapters_disabled(model)` turns every adapter path off for its body (PEFT's disable_adapter()): the layers compute
W x + b alone, exactly the base model's outputs (DPO's reference policy with LoRA, no second copy of the weights).

Parameter names: `<linear>.lora_A`, `<linear>.lora_B` (e.g. transformer.layers.0.attention.query_key_value.lora_B).
"""
import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from .utils import get_device

# The targets a LoRAConfig names -> the linear inside a transformer layer (the --lora-targets names).
TARGETS = {"qkv": "attention.query_key_value", "dense": "attention.dense", "fc1": "mlp.dense_h_to_4h",
           "fc2": "mlp.dense_4h_to_h"}
LORA_PARAMETERS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    """r: the adapters' inner dimension (at least 1)."""
    alpha: float = 8.0
    """The adapters' output is scaled by alpha / r (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout probability on the adapters' input, in [0, 1)."""
    targets: tuple = tuple(TARGETS)
    """Which linears of every layer get an adapter: names from TARGETS."""
    zero_init_b: bool = True
    """B starts at zero (PEFT's default: a fresh adapter leaves the model unchanged). False draws B like A (PEFT's
    init_lora_weights=False): a fresh adapter changes the output, which tests use."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {list(self.targets)}: name each of {', '.join(TARGETS)} at most once")

    @property
    def scale(self):
        """alpha / r, the factor on B A x."""
        return self.alpha / self.rank


def add_lora(transformer, config):
    """Give every target linear of `transformer` (a ParallelTransformer, possibly one pipeline stage of it) a
    LoRA adapter; masters drawn as the module docstring says. Freezes nothing (mark_only_lora_as_trainable)."""
    layers = dict(transformer.numbered_layers())                 # global layer number -> this stage's layer
    template = next(iter(layers.values()))                       # every layer has the same shapes
    device = get_device()
    for number in range(transformer.num_layers):
        for target in (t for t in TARGETS if t in config.targets):
            linear = template.get_submodule(TARGETS[target])
            lora_a = torch.empty(config.rank, linear.input_size, device=device)
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
            lora_b = torch.zeros(linear.output_size, config.rank, device=device)
            if not config.zero_init_b:
                nn.init.kaiming_uniform_(lora_b, a=math.sqrt(5))
            if number in layers:
                layers[number].get_submodule(TARGETS[target]).add_lora(lora_a, lora_b, config.scale, config.dropout)


def is_lora_parameter(name):
    """Whether a parameter name is an adapter's (the last component is lora_A or lora_B)."""
    return name.rsplit(".", 1)[-1] in LORA_PARAMETERS


def fresh_adapters(param_names, saved_names):
    """The adapters among `param_names` that loading a checkpoint holding `saved_names` leaves at their
    initialization: all of them when the checkpoint has no adapter at all (a base model's, the start of LoRA
    fine-tuning), else none (a LoRA checkpoint must hold every adapter the model has)."""
    if any(map(is_lora_parameter, saved_names)):
        return set()
    return {name for name in param_names if is_lora_parameter(name)}


def mark_only_lora_as_trainable(module):
    """requires_grad False on every parameter of `module` but the adapters' (PEFT's name): the frozen ones get no
    gradient and no optimizer state. Returns the number of trainable elements."""
    trainable = 0
    for name, param in module.named_parameters():
        param.requires_grad_(is_lora_parameter(name))
        trainable += param.numel() if param.requires_grad else 0
    return trainable


def has_adapters(module):
    """Whether any linear of `module` carries a LoRA adapter."""
    return any(getattr(m, "lora_A", None) is not None for m in module.modules())


@contextlib.contextmanager
def adapters_disabled(module):
    """Within the block every adapter of `module` (any wrapper around it too: only its submodules are touched) is
    skipped: the forward is the base model's, bitwise. Restored on exit, exceptions included."""
    linears = [m for m in module.modules() if getattr(m, "lora_A", None) is not None]
    previous = [m.lora_disabled for m in linears]
    for linear in linears:
        linear.lora_disabled = True
    try:
        yield
    finally:
        for linear, value in zip(linears, previous):
            linear.lora_disabled = value
