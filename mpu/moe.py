"""Mixture-of-experts MLP (Megatron-LM's --num-experts, --moe-router-topk, ...): a router picks k of E expert MLPs
per token; the token's output is the routing-weighted sum of their outputs.

    logits  = x W_r^T                                   [T, E]   (T = b s tokens, W_r replicated)
    softmax router: experts = top-k(logits), weights = softmax(top-k logits)       (Mixtral's; = renormalized
                    top-k of softmax(logits)); probs = softmax(logits)
    sigmoid router: scores = sigmoid(logits), experts = top-k(scores), weights = scores / their sum (k > 1;
                    k = 1: the score itself); probs = scores / sum over E
    aux loss (Switch/GShard) = aux_coeff * E * sum_e f_e P_e,  f_e = tokens routed to e / (T k) (before any drop),
                                                               P_e = mean over tokens of probs[:, e]
    z-loss (ST-MoE)          = z_coeff * mean over tokens of logsumexp(logits)^2

Capacity (capacity_factor c; None: dropless): each expert takes at most C = ceil(T k c / E) of this rank's tokens,
those that score it highest (Megatron-LM's "probs" drop policy), the earlier token first among equals. The score is
the router's over all E experts, softmax(logits) or sigmoid(logits) (top-1's weights, all 1, would tie), compared as
log_softmax(logits) or logits: the same order, without the saturation near 1 that makes fp32 probabilities tie. A
dropped assignment contributes nothing (the token keeps the rest of its weighted sum, and its residual). T is this
rank's micro-batch, before dispatch, so the result does not depend on the expert-parallel size.

Expert parallelism (mpu/expert_parallel.py): this rank holds experts [r E/EP, (r+1) E/EP) of its
expert-model-parallel group, registered under their global numbers (`experts.5....` is expert 5 at every EP); every
rank builds the router and draws every expert's initial weights in order (keeping its own), so the weights equal the
single-process model's. Dispatch, per layer and micro-batch:

    1. all T k assignments sorted by expert on the device (kept ones expert-major, token order within an expert,
       then the ones a capacity drops): rows [T k, h], a fixed size (dispatch_order: no host read)
    2. the row counts per expert, [EP, E/EP], all-to-all (fixed size: every rank joins, also with nothing to send),
       and the split sizes read on the host: the layer's one host read (none at EP 1 on the grouped kernel)
    3. the kept rows all-to-all to the experts' ranks (split sizes from 2; empty pieces are normal)
    4. the local experts run on their rows: one grouped matmul per linear (mpu/grouped_experts.py) where the
       kernel exists, else one expert after another (zero rows: an empty matmul, its gradient zeros)
    5. the outputs all-to-all back (3's reverse), weighted, summed per token in a fixed order (each in a slot of its
       token, the k slots summed, a dropped one 0: no two rows added into one place, so deterministic on CUDA too)

The aux and z losses join backward through the output (Megatron-LM's MoEAuxLossAutoScaler): the forward returns the
MLP's output unchanged, and backward adds their gradient with the weight set_aux_loss_scale() gave (the engine
sets its loss scale / accumulation steps, the factor the LM loss is backpropagated with). `last_statistics` keeps the
last forward's aux loss and tokens per expert (device tensors, read only when the training log asks).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .expert_parallel import all_to_all, exchange_counts
from .grouped_experts import grouped_forward, grouped_supported
from .initialize import (get_expert_model_parallel_group, get_expert_model_parallel_rank,
                         get_expert_model_parallel_world_size)
from .layers import ColumnParallelLinear, RowParallelLinear
from .random import skip_init_draws
from .utils import divide, get_device

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE options of a model (docs/models.md)."""
    num_experts: int
    """--num-experts: experts per MoE layer (E)."""
    topk: int = 2
    """--moe-router-topk: experts per token (k)."""
    router: str = "softmax"
    """--moe-router-score-function: 'softmax' or 'sigmoid' (see the module docstring)."""
    aux_loss_coeff: float = 0.0
    """--moe-aux-loss-coeff: weight of the load-balancing loss."""
    z_loss_coeff: float = 0.0
    """--moe-z-loss-coeff: weight of the router z-loss."""
    capacity_factor: Optional[float] = None
    """--moe-expert-capacity-factor: each expert takes at most ceil(T k c / E) tokens; None: dropless."""
    layer_freq: int = 1
    """--moe-layer-freq: layer i is an MoE layer when i % layer_freq == 0 (1: every layer)."""

    def __post_init__(self):
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk ({self.topk}) must be between 1 and --num-experts "
                             f"({self.num_experts})")
        if self.router not in ROUTERS:
            raise ValueError(f"--moe-router-score-function {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor ({self.capacity_factor}) must be > 0 (omit it: dropless)")
        if self.layer_freq < 1:
            raise ValueError(f"--moe-layer-freq ({self.layer_freq}) must be >= 1")

    def is_moe_layer(self, number):
        return number % self.layer_freq == 0

    def capacity(self, num_tokens):
        """Tokens one expert takes from `num_tokens` (None: all it is routed)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.topk * self.capacity_factor / self.num_experts)


# ---- the aux losses' way into backward ---------------------------------------------------------------------------
_AUX_LOSS_SCALE = [1.0]


def set_aux_loss_scale(scale):
    """The factor the aux losses' gradient gets: what the LM loss is multiplied by before backward (loss scale /
    gradient-accumulation steps under the engine; 1.0 for a plain loss.backward())."""
    _AUX_LOSS_SCALE[0] = float(scale)


class _AttachAuxLoss(torch.autograd.Function):
    """forward(output, aux) = output; backward adds d(scale * aux)/d(aux) = scale to aux's gradient."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, _AUX_LOSS_SCALE[0])


# ---- routing -----------------------------------------------------------------------------------------------------
def route(logits, config):
    """logits [T, E] (fp32) -> (weights [T, k], experts [T, k], probs [T, E], ranks [T, E]) (module docstring;
    ranks: what the capacity keeps the highest of, in the order of softmax(logits) or sigmoid(logits))."""
    if config.router == "softmax":
        top_logits, experts = logits.topk(config.topk, dim=-1)
        return (torch.softmax(top_logits, dim=-1), experts, torch.softmax(logits, dim=-1),
                torch.log_softmax(logits, dim=-1))
    scores = torch.sigmoid(logits)
    top, experts = scores.topk(config.topk, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True) if config.topk > 1 else top
    return weights, experts, scores / scores.sum(dim=-1, keepdim=True), logits


def aux_losses(logits, probs, tokens_per_expert, config):
    """The load-balancing loss plus the z-loss (0-dim fp32; 0 when both coefficients are 0)."""
    total = logits.new_zeros(())
    num_tokens = logits.size(0)
    if config.aux_loss_coeff:
        fraction = tokens_per_expert.float() / (num_tokens * config.topk)                 # f_e  [E]
        total = total + config.aux_loss_coeff * config.num_experts * (fraction * probs.mean(dim=0)).sum()
    if config.z_loss_coeff:
        total = total + config.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    return total


def kept_assignments(weights, experts, ranks, config):
    """(routing weight map [T, E], routed mask [T, E], kept mask [T, E]): kept = routed, less what the capacity
    drops (per expert, its C assignments of highest rank)."""
    num_tokens = weights.size(0)
    routing = weights.new_zeros(num_tokens, config.num_experts).scatter(1, experts, weights)
    routed = torch.zeros_like(routing, dtype=torch.bool).scatter(1, experts, True)
    capacity = config.capacity(num_tokens)
    if capacity is None or capacity >= num_tokens:
        return routing, routed, routed
    # a stable sort: equal ranks (tokens of identical prefixes have identical hidden states) keep the earlier token,
    # whatever the other values (topk's choice among ties is not fixed)
    order = ranks.detach().masked_fill(~routed, -math.inf).sort(dim=0, descending=True, stable=True).indices
    best = order[:capacity]                                                                     # [C, E]
    within = torch.zeros_like(routed).scatter(0, best, True)
    return routing, routed, routed & within


# ---- the layer ---------------------------------------------------------------------------------------------------
class Expert(nn.Module):
    """One expert: the dense MLP's shape (GELU h -> f -> h, or SwiGLU with the fused [gate; up] at stride 2),
    tensor-parallel as ParallelMLP; no dropout (the MoE layer drops out the combined output)."""

    def __init__(self, hidden_size, ffn_hidden_size, swiglu, bias, init_method, output_layer_init_method):
        super().__init__()
        self.swiglu = swiglu
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, (2 if swiglu else 1) * ffn_hidden_size,
                                                  gather_output=False, init_method=init_method,
                                                  stride=2 if swiglu else 1, bias=bias)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size, input_is_parallel=True,
                                               init_method=output_layer_init_method, bias=bias)
        for param in self.parameters():
            param.expert_parallel = True

    def forward(self, rows):
        projected = self.dense_h_to_4h(rows)                                   # [n, f/p or 2f/p]
        if self.swiglu:
            gate, up = projected.chunk(2, dim=-1)
            return self.dense_4h_to_h(F.silu(gate) * up)                       # [n, h]
        return self.dense_4h_to_h(F.gelu(projected, approximate="tanh"))


def expert_init_shapes(hidden_size, ffn_hidden_size, swiglu):
    """The full-size masters one Expert draws, in build order."""
    return [((2 if swiglu else 1) * ffn_hidden_size, hidden_size), (hidden_size, ffn_hidden_size)]


def moe_init_shapes(hidden_size, ffn_hidden_size, swiglu, config):
    """What one MoE MLP draws from the default generator, in build order: the router, then every expert."""
    return [(config.num_experts, hidden_size)] + \
        expert_init_shapes(hidden_size, ffn_hidden_size, swiglu) * config.num_experts


class _Router(nn.Module):
    def __init__(self, hidden_size, num_experts, init_method):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=get_device()))  # replicated
        init_method(self.weight)


class _LocalExperts(nn.Module):
    """This rank's experts under their global numbers."""

    def __init__(self, experts, first):
        super().__init__()
        for offset, expert in enumerate(experts):
            self.add_module(str(first + offset), expert)

    def __iter__(self):
        return iter(self._modules.values())


class MoEMLP(nn.Module):
    """The MoE layer (module docstring): forward(hidden_states [b, s, h]) -> [b, s, h]."""

    graph_capturable = False
    """Its dispatch reads token counts on the host (the split sizes; not at EP 1 on the grouped kernel, but the
    grouped kernel is unchecked inside a graph): generation decodes it without a CUDA graph
    (megatron/text_generation/capture.py)."""

    def __init__(self, hidden_size, ffn_hidden_size, config, init_method, output_layer_init_method, swiglu=False,
                 bias=True, output_dropout_prob=0.0):
        super().__init__()
        self.config = config
        self.group = get_expert_model_parallel_group()
        self.ep = get_expert_model_parallel_world_size()
        self.local = divide(config.num_experts, self.ep, "--num-experts / --expert-model-parallel-size")
        first = get_expert_model_parallel_rank() * self.local
        shapes = expert_init_shapes(hidden_size, ffn_hidden_size, swiglu)
        self.router = _Router(hidden_size, config.num_experts, init_method)
        skip_init_draws(shapes * first, get_device())                       # the experts before this rank's
        self.experts = _LocalExperts([Expert(hidden_size, ffn_hidden_size, swiglu, bias, init_method,
                                             output_layer_init_method) for _ in range(self.local)], first)
        skip_init_draws(shapes * (config.num_experts - first - self.local), get_device())   # and after
        self.dropout = nn.Dropout(output_dropout_prob)
        self.last_statistics = None       # (aux loss, tokens per expert [E]) of the last forward, device tensors

    def forward(self, hidden_states, layer_past=None, sequence_parallel=False):
        if sequence_parallel:
            raise ValueError("the MoE layer runs on whole sequences: drop --sequence-parallel")
        b, s, h = hidden_states.shape
        tokens = hidden_states.reshape(b * s, h)                                          # [T, h]
        logits = F.linear(tokens, self.router.weight).float()                            # [T, E]
        weights, experts, probs, ranks = route(logits, self.config)
        routing, routed, kept = kept_assignments(weights, experts, ranks, self.config)
        tokens_per_expert = routed.sum(dim=0)                                              # [E] before drops
        aux = aux_losses(logits, probs, tokens_per_expert, self.config)
        self.last_statistics = (aux.detach(), tokens_per_expert.detach())
        token_ids, slots, expert_ids, kept_rows = dispatch_order(experts, kept, self.config.num_experts)
        k = self.config.topk
        # each row read from (and its output written to) slot `slots` of its token (its expert's place among the
        # token's k, in expert order): every (token, slot) once, so neither direction adds two rows into one place
        # (index_add / a plain gather's backward would, by atomics on CUDA, in the order the threads arrive); the
        # k slots are summed in order (a dropped assignment's slot holds 0)
        rows = self._run_experts(tokens.unsqueeze(1).expand(-1, k, -1)[token_ids, slots], kept.sum(dim=0),
                                 expert_ids)                                                 # [T k, h]
        gate = routing[token_ids, expert_ids].to(rows.dtype)                             # [T k]
        per_slot = rows.new_zeros(b * s, k, h)                                           # [T, k, h]
        rows = torch.where(kept_rows[:, None], rows, 0)          # a dropped row's output: 0, its gradient 0
        per_slot[token_ids, slots] = rows * gate[:, None]
        output = per_slot.sum(dim=1)                                                     # [T, h]
        if self.training and (self.config.aux_loss_coeff or self.config.z_loss_coeff) and aux.requires_grad:
            output = _AttachAuxLoss.apply(output, aux)
        return self.dropout(output).view(b, s, h)

    def _run_experts(self, rows, counts, expert_ids):
        """rows [T k, h] sorted by expert (the dropped after the kept), counts [E] kept rows per expert,
        expert_ids [T k] -> each kept row through its expert, in the same order (rows past the kept: finite, masked
        by the caller). At EP 1 on the grouped kernel nothing is read on the host (the last expert's group runs on
        to the end, over the dropped rows); otherwise the split sizes are, in one read."""
        grouped = grouped_supported(list(self.experts), rows.dtype, rows.device)
        if self.ep == 1 and grouped:
            ends = torch.cat([counts[:-1].cumsum(0), counts.new_full((1,), rows.size(0))])
            return grouped_forward(list(self.experts), rows, ends.to(torch.int32), expert_ids)
        by_rank = counts.view(self.ep, self.local)                       # [EP, E/EP] rows for each rank's experts
        received = exchange_counts(by_rank, self.group)                  # [EP, E/EP] rows from each rank
        host = torch.cat([by_rank.sum(dim=1), received.reshape(-1)]).tolist()          # the layer's one host read
        send, got = host[:self.ep], [host[self.ep + r * self.local:][:self.local] for r in range(self.ep)]
        kept = rows[:sum(send)]
        if self.ep > 1:
            kept = all_to_all(kept, [sum(c) for c in got], send, self.group)   # source-major, expert-minor
        order = _expert_major_order(got, rows.device)                    # None when already expert-major
        if order is not None:
            kept = kept[order]
        sizes = [sum(source[j] for source in got) for j in range(self.local)]
        if grouped:                                                      # the sizes from the device's counts
            ends = received.sum(dim=0).cumsum(0)                         # [E/EP]
            local = torch.searchsorted(ends, torch.arange(kept.size(0), device=rows.device), right=True)
            outputs = grouped_forward(list(self.experts), kept, ends.to(torch.int32), local)
        else:
            outputs = torch.cat([expert(piece) for expert, piece in zip(self.experts, kept.split(sizes))])
        if order is not None:
            outputs = outputs[torch.argsort(order)]                      # back to the received order
        if self.ep > 1:
            outputs = all_to_all(outputs, send, [sum(c) for c in got], self.group)
        return torch.cat([outputs, outputs.new_zeros(rows.size(0) - outputs.size(0), rows.size(1))])


def dispatch_order(experts, kept, num_experts):
    """experts [T, k] (each token's chosen experts), kept [T, E] -> (token_ids, slots, expert_ids, kept_rows), each
    [T k]: every assignment once, the kept ones expert-major (token order within an expert), then the dropped ones.
    A fixed size whatever the routing, computed on the device: no host read. slot = the expert's place among its
    token's k experts in expert order."""
    k = experts.size(1)
    chosen = experts.sort(dim=1).values                                             # [T, k] ascending
    expert_of = chosen.reshape(-1)                                                  # [T k] token-major
    keep = kept.gather(1, chosen).reshape(-1)                                       # [T k]
    order = torch.where(keep, expert_of, num_experts).argsort(stable=True)          # kept expert-major, dropped last
    return order // k, order % k, expert_of[order], keep[order]


def _expert_major_order(counts, device):
    """Row indices that sort rows received as counts[source][expert] blocks (source-major) into expert-major order;
    None when there is one source."""
    if len(counts) == 1:
        return None
    starts, position = [], 0
    for source in counts:
        starts.append([])
        for count in source:
            starts[-1].append(position)
            position += count
    pieces = [torch.arange(starts[s][j], starts[s][j] + counts[s][j], device=device)
              for j in range(len(counts[0])) for s in range(len(counts))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def moe_statistics(module):
    """[(aux loss, tokens per expert [E])] of every MoE layer's last forward in `module` (device tensors)."""
    return [m.last_statistics for m in module.modules() if isinstance(m, MoEMLP) and m.last_statistics is not None]
