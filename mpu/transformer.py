"""The model-parallel GPT-2 transformer: self-attention, MLP, layer and stack (pre-LayerNorm, as GPT-2).

Activations are [b, s, h] (batch, sequence, hidden). With p model-parallel ranks each rank holds heads/p
attention heads and 4h/p MLP columns: column-parallel in, row-parallel out, one all-reduce per block.

Sequence parallelism (`ParallelTransformer(..., sequence_parallel=True)`, Megatron-LM's --sequence-parallel): the
stack's input and output and everything between the blocks (LayerNorms, hidden dropout, residual adds) are this
rank's slice of the sequence, [b, s/p, h]; each block all-gathers the sequence before its column-parallel linear
and reduce-scatters after its row-parallel one (the all-reduce's two halves), and the LayerNorms' and row-parallel
biases' gradients are summed over the group, a layer's six in one all-reduce
(mpu.layers.replicated_gradients_together). The hidden dropouts keep each rank's slice of the whole sequence's mask
(mpu.layers.replicated_mask_dropout), so the run equals the one without; incremental decoding runs without it.

Activation checkpointing and dropout RNG come from the builder: `ParallelTransformer(...,
checkpoint_function=..., rng_tracker=...)` (default: mpu's own `checkpoint` and `get_cuda_rng_tracker()`).
The model builder passes zero.checkpointing's pair when it is configured, so mpu imports nothing but torch.
What is recomputed (nothing, the attention core of every layer, or whole layers in groups) is a RecomputeConfig
(mpu/recompute.py): `ParallelTransformer(..., recompute=...)`.

Llama-family options (`Architecture`): grouped-query attention (fewer key/value heads, each shared by a group of
query heads), SwiGLU MLP, RMSNorm, no biases, another MLP width; rotary embeddings come in as (cos, sin) tables.

Incremental decoding: pass one `InferenceCache` through `ParallelTransformer.forward(..., inference_cache=cache)`
(GPT2Model.forward does). Each attention layer writes this step's keys/values (its own heads/p heads) into its
slot's preallocated buffers, so a step feeds only the new tokens; `cache.sequence_length` is how many positions
are already cached. Static decoding (`cache.write_at(position)`, what generation's one-token steps use): every
step has the same shapes and reads only fixed buffers, so it can be captured as a CUDA graph: the token's
keys/values go to the slot a device tensor names, and attention reads all `capacity` slots under the caller's
mask, which hides the slots not written yet (and the padding).
"""
import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import fused as compiled_ops
from .context_parallel import ring_attention
from .initialize import get_context_parallel_world_size, get_model_parallel_world_size
from .layers import (ColumnParallelLinear, GroupedQKVStride, LayerNorm, replicated_gradients_together,
                     replicated_mask_dropout, RMSNorm, RowParallelLinear)
from .mappings import copy_to_model_parallel_region, reduce_from_model_parallel_region
from .moe import MoEConfig, MoEMLP, moe_init_shapes
from .random import checkpoint as mpu_checkpoint
from .random import get_cuda_rng_tracker
from .recompute import RecomputeConfig
from .rotary import apply_rotary
from .utils import divide, get_device


@dataclass(frozen=True)
class Architecture:
    """The layer's shape options (the defaults are GPT-2's)."""
    num_key_value_heads: Optional[int] = None
    """Key/value heads (grouped-query attention; None: one per query head). Query head j uses key/value head
    j // (heads / kv heads). Split across model-parallel ranks when a multiple of the model-parallel size;
    replicated when fewer (the model-parallel size a multiple of them): each rank holds the head its query heads
    use, and the copies' gradients (LoRA's lora_B too) are summed over their holders in backward
    (layers.GroupedQKVStride)."""
    ffn_hidden_size: Optional[int] = None
    """The MLP's inner width (None: 4 x hidden)."""
    swiglu: bool = False
    """MLP = down(silu(gate(x)) * up(x)); gate and up are one column-parallel linear, rank r holding
    [gate_r; up_r] (stride 2), so every rank has the matching columns of both."""
    normalization: str = "layernorm"
    """'layernorm' or 'rmsnorm' (no bias, no mean subtraction)."""
    add_bias_linear: bool = True
    """Biases on the attention and MLP linears."""
    moe: Optional[MoEConfig] = None
    """Mixture of experts (mpu/moe.py): the layers MoEConfig.is_moe_layer names have an MoEMLP (experts of the MLP's
    shape) instead of the MLP; None: every layer dense."""

    def for_layer(self, number):
        """This architecture for layer `number`: without `moe` where that layer is dense."""
        if self.moe is None or self.moe.is_moe_layer(number):
            return self
        return dataclasses.replace(self, moe=None)

    def kv_heads(self, num_attention_heads):
        return self.num_key_value_heads or num_attention_heads

    def ffn_size(self, hidden_size):
        return self.ffn_hidden_size or 4 * hidden_size

    def qkv_rows(self, hidden_size, num_attention_heads):
        """The fused q/k/v master's row blocks: (q, k, v) = (heads, kv heads, kv heads) x head_dim."""
        head_dim = hidden_size // num_attention_heads
        kv = self.kv_heads(num_attention_heads) * head_dim
        return (hidden_size, kv, kv)


GPT2_ARCHITECTURE = Architecture()


def norm_layer(architecture, hidden_size, eps, device):
    """The LayerNorm or RMSNorm of `architecture` (mpu.layers': nn.LayerNorm / nn.RMSNorm whose
    `forward(x, sequence_parallel=True)` sums the weight's (and bias's) gradient over the model-parallel group)."""
    if architecture.normalization == "rmsnorm":
        return RMSNorm(hidden_size, eps=eps, device=device)
    if architecture.normalization != "layernorm":
        raise ValueError(f"normalization must be 'layernorm' or 'rmsnorm', got {architecture.normalization!r}")
    return LayerNorm(hidden_size, eps=eps, device=device)


def init_method_normal(std):
    def init_(tensor):
        return nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def scaled_init_method_normal(std, num_layers):
    """GPT-2's init for the projections that write into the residual stream: std / sqrt(2 L)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


class LayerPast:
    """One attention layer's cached keys and values. The buffers, [b, heads/p, capacity, head_dim] each, are
    allocated at the first write (with that step's batch, dtype and device) and written in place after: no
    reallocation or copy of the past per step.

        slot = LayerPast(capacity=8)
        k, v = slot.append(k3, v3)   # [b, heads/p, 3, d] -> views of positions 0..2
        k, v = slot.append(k1, v1)   # written at position 3 -> views of positions 0..3; slot.length == 4

    Static decoding (`position` set: a long tensor [1] on the device, InferenceCache.write_at): a one-token step
    writes at slot position[0] (index_copy_, no host read) and returns the whole buffers [b, heads/p, capacity,
    head_dim]; the caller's mask hides the slots past it and keeps `length` (InferenceCache.set_length).
    """

    def __init__(self, capacity, transposed=None):
        self.capacity = capacity
        self.key_buffer = None      # [b, heads/p, capacity, head_dim]
        self.value_buffer = None
        self.length = 0             # positions written
        self.transposed = transposed if transposed is not None else {}   # shared by a cache's layers
        self.position = None        # static decoding: a long tensor [1], the slot a one-token step writes

    def weight_t(self, weight):
        """decoding_weight_t of `weight`, made once per cache."""
        return decoding_weight_t(self.transposed, weight)

    def append(self, key, value):
        """Write key/value [b, heads/p, s, head_dim] at positions length..length+s-1; returns the keys and values
        of every position so far, [b, heads/p, length, head_dim] (views of the buffers)."""
        if self.position is not None:
            if self.key_buffer is None or key.size(2) != 1:
                raise ValueError(f"static decoding writes one token per step after a prompt, this step has "
                                 f"{key.size(2)} and {'no' if self.key_buffer is None else 'a'} prompt cached")
            self.key_buffer.index_copy_(2, self.position, key)
            self.value_buffer.index_copy_(2, self.position, value)
            return self.key_buffer, self.value_buffer
        end = self.length + key.size(2)
        if end > self.capacity:
            raise ValueError(f"the inference cache holds {self.capacity} positions, this step needs {end}: make "
                             "the cache with a larger capacity")
        if self.key_buffer is None:
            b, heads, _, head_dim = key.shape
            # zeros, not empty: static decoding reads every slot, and a masked slot's garbage (NaN) would still
            # reach the output through probability 0 x NaN
            self.key_buffer = key.new_zeros(b, heads, self.capacity, head_dim)
            self.value_buffer = value.new_zeros(b, heads, self.capacity, head_dim)
        self.key_buffer[:, :, self.length:end] = key
        self.value_buffer[:, :, self.length:end] = value
        self.length = end
        return self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]


class InferenceCache:
    """Keys/values of every layer for the tokens already processed, up to `capacity` positions (inference only;
    never used in training)."""

    def __init__(self, num_layers, capacity):
        self.transposed = {}             # id(weight) -> its decoding layout (decoding_weight_t)
        self.layers = [LayerPast(capacity, self.transposed) for _ in range(num_layers)]

    def write_at(self, position):
        """Static decoding from now on: each one-token step writes its keys/values at slot position[0] (`position`:
        a long tensor [1] on the cache's device, which the caller updates in place between steps) and attention
        reads every slot, so the caller passes a mask over all `capacity` keys. A prompt is written before
        (plain appends)."""
        for layer in self.layers:
            layer.position = position

    def set_length(self, length):
        """Static decoding: record that `length` positions are cached (the steps do not count, they are replayed
        without the host)."""
        for layer in self.layers:
            layer.length = length

    def head_matmul(self, weight, rows):
        """decoding_head_matmul of the LM head's `weight` for `rows` rows, its layout made once per cache."""
        return decoding_head_matmul(self.transposed, weight, rows)

    @property
    def sequence_length(self):
        """Positions already cached: the next token's position id."""
        return self.layers[0].length if self.layers else 0


ONEDNN_HEAD_MIN_ROWS = 4     # below it MKL's GEMM on the transposed copy is as fast or faster (see below)


def decoding_head_matmul(store, weight, rows):
    """x -> x @ weight^T for the LM head while decoding `rows` rows a step on CPU, its weight layout made once and
    kept in `store`; None where there is none (not on CPU, a ZeRO-3 weight gathered per unit). From
    ONEDNN_HEAD_MIN_ROWS rows on, oneDNN's linear on a weight it packed (torch.ops.mkldnn, where this build has it,
    float32): MKL's GEMM with 4-16 rows and 8192 columns runs 1.5-3x slower than that (one thread, weights out of
    cache, 8192 x 256: 8 rows 2.52 vs 1.38 ms, 4 rows 2.12 vs 0.86 ms), while at 1 or 2 rows its GEMV on the
    transposed copy is faster (0.46 vs 0.81 ms at 1 row). Packing costs about what transposing does. Only without
    autograd (generate runs under no_grad); with it, the transposed copy."""
    if (rows >= ONEDNN_HEAD_MIN_ROWS and weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and _onednn_linear_available()):      # the oneDNN op has no autograd formula
        if not _decodable(weight):
            return None
        key = ("onednn", id(weight))
        if key not in store:
            store[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        packed = store[key]
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    weight_t = decoding_weight_t(store, weight)
    return None if weight_t is None else (lambda x: torch.matmul(x, weight_t))


def _onednn_linear_available():
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _decodable(weight):
    """A CPU weight that stays whole for the whole call (not a ZeRO-3 parameter gathered per unit)."""
    manager = getattr(weight, "ds_manager", None)
    return weight.device.type == "cpu" and (manager is None or manager.hooks_bypassed)


def decoding_weight_t(store, weight):
    """A weight [out, in] with out > in (the LM head, q/k/v, the MLP's first linear) transposed into a contiguous
    [in, out] copy for decoding on CPU, kept in `store` (one generation call's cache: the weights do not change
    while decoding); None otherwise. On CPU x W^T with such a W runs a GEMV kernel up to 2.6x slower than
    x (W^T contiguous) (one thread, weights out of cache, batch 1: 8192 x 256 1.13 vs 0.43 ms, 1024 x 256 143 vs
    64 us; the other way round, out < in, it is slower: kept as it is). Not on other devices (cuBLAS takes either
    layout at the same speed), and not for a ZeRO-3 parameter gathered per unit (a whole copy would outlive its
    unit's release; the Hybrid Engine's gathered_for_inference holds them whole anyway)."""
    if not _decodable(weight) or weight.dim() != 2 or weight.size(0) <= weight.size(1):
        return None
    if id(weight) not in store:
        store[id(weight)] = weight.detach().t().contiguous()
    return store[id(weight)]


class ParallelSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
                 init_method, output_layer_init_method, rng_tracker=None, architecture=GPT2_ARCHITECTURE):
        super().__init__()
        self.rng_tracker = rng_tracker if rng_tracker is not None else get_cuda_rng_tracker()
        world_size = get_model_parallel_world_size()
        self.hidden_size_per_partition = divide(hidden_size, world_size, "hidden size / model-parallel size")
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden size / attention heads")
        self.heads_per_partition = divide(num_attention_heads, world_size, "attention heads / model-parallel size")
        kv_heads = architecture.kv_heads(num_attention_heads)
        divide(num_attention_heads, kv_heads, "attention heads / key-value heads")
        if kv_heads >= world_size:
            self.kv_heads_per_partition = divide(kv_heads, world_size, "key-value heads / model-parallel size")
        else:   # replicated: one head per rank
            divide(world_size, kv_heads, "model-parallel size / key-value heads (fewer than the ranks)")
            self.kv_heads_per_partition = 1
        q_rows, kv_rows, _ = architecture.qkv_rows(hidden_size, num_attention_heads)
        # stride 3: rank r holds [q_r, k_r, v_r], matching a fused [q; k; v] master weight (with fewer key/value
        # heads the blocks differ in size, and may be replicated: GroupedQKVStride).
        stride = 3 if kv_heads == num_attention_heads else GroupedQKVStride(q_rows, kv_rows, self.head_dim)
        self.query_key_value = ColumnParallelLinear(hidden_size, q_rows + 2 * kv_rows, gather_output=False,
                                                    stride=stride, init_method=init_method,
                                                    bias=architecture.add_bias_linear)
        self.attention_dropout_prob = attention_dropout_prob
        self.dense = RowParallelLinear(hidden_size, hidden_size, input_is_parallel=True,
                                       init_method=output_layer_init_method, bias=architecture.add_bias_linear)
        self.output_dropout = nn.Dropout(output_dropout_prob)
        self.checkpoint_core_attention = False   # selective recomputation (ParallelTransformer sets it)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, rotary=None, sequence_parallel=False):
        # hidden_states: [b, s, h] ([b, s/p, h] sequence_parallel); attention_mask: None (causal) or bool
        # [b or 1, 1, s, t], True = masked out, t = past + s keys. layer_past: a LayerPast to read the cached
        # keys/values from and append this step's to. rotary: None or the (cos, sin) tables of the whole sequence's
        # s positions (mpu.rotary), applied to q and k per head: the column-parallel q/k/v linear has gathered the
        # sequence, so q, k, v (and rotary, GQA's repeat and the core) cover all s positions.
        qkv = self.query_key_value(hidden_states, weight_t=None if layer_past is None else
                                   layer_past.weight_t(self.query_key_value.weight),
                                   sequence_parallel=sequence_parallel)     # [b, s, (n + 2 n_kv) d / p]
        b, s, _ = qkv.shape
        kv_width = self.kv_heads_per_partition * self.head_dim
        q, k, v = qkv.split([self.hidden_size_per_partition, kv_width, kv_width], dim=-1)
        q = q.view(b, s, self.heads_per_partition, self.head_dim).transpose(1, 2)         # [b, n/p, s, d]
        k, v = (t.view(b, s, self.kv_heads_per_partition, self.head_dim).transpose(1, 2) for t in (k, v))
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        past = 0
        if layer_past is not None:
            past = layer_past.length
            if layer_past.position is not None and attention_mask is None:
                raise ValueError("static decoding reads every cache slot: pass the mask that hides the slots not "
                                 "written yet")
            k, v = layer_past.append(k, v)                  # [b, n_kv/p, past + s, d] (static: capacity)
        group = self.heads_per_partition // self.kv_heads_per_partition
        ring = layer_past is None and get_context_parallel_world_size() > 1   # context parallel: ring attention
        if group > 1 and not ring:   # kv head j serves query heads j*group .. (j+1)*group - 1 (HF's repeat_kv)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [b, n/p, t, d]
        if self.checkpoint_core_attention and self.training and q.requires_grad:   # else autograd keeps nothing
            # Selective recomputation: keep q, k, v (views of qkv) and recompute the core in backward under the
            # forward's RNG states (default and tracker), so its dropout mask is the one drawn here. mpu's plain
            # checkpoint, never a partitioning one: q, k, v hold this rank's heads, they are not replicated.
            def core(q, k, v, *mask):
                return self.core_attention(q, k, v, *mask, past=past)
            context = mpu_checkpoint(core, q, k, v, *(() if attention_mask is None else (attention_mask,)))
        else:
            context = self.core_attention(q, k, v, attention_mask, past=past)      # [b, s, h/p]
        output = self.dense(context, sequence_parallel=sequence_parallel)         # [b, s, h] or [b, s/p, h]
        return hidden_dropout(self.output_dropout, output, sequence_parallel)

    def core_attention(self, q, k, v, attention_mask=None, past=0):
        """softmax(q k^T / sqrt(d) + mask) with attention dropout, times v (Megatron's "core attention": what
        selective recomputation recomputes). q: [b, heads/p, s, d]; k, v: [b, heads/p, past + s, d] -> the
        context [b, s, h/p]."""
        b, _, s, _ = q.shape
        dropout_p = self.attention_dropout_prob if self.training else 0.0
        if past == 0 and get_context_parallel_world_size() > 1:
            # this rank's 2 chunks of the sequence against every rank's keys/values (k, v: n_kv heads, not repeated)
            if attention_mask is not None or dropout_p > 0:
                raise ValueError("context parallelism runs causal attention without a mask or attention dropout")
            context = ring_attention(q, k, v)                                      # [b, n/p, s, d]
            return context.transpose(1, 2).reshape(b, s, self.hidden_size_per_partition)
        # Heads differ across model-parallel ranks, so their dropout masks come from the per-rank stream. Without
        # dropout nothing is drawn: skip saving and restoring the RNG states (~20 us per layer and step).
        with self.rng_tracker.fork() if dropout_p > 0 else contextlib.nullcontext():
            if attention_mask is not None:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=dropout_p)
            elif past == 0:  # query length == key length: SDPA's own causal mask
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            elif s == 1:     # one new token sees every cached key and itself
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            else:            # all past keys, causal over the s new ones (is_causal would align top-left)
                allowed = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        return context.transpose(1, 2).reshape(b, s, self.hidden_size_per_partition)  # [b, s, h/p]


def hidden_dropout(dropout, hidden_states, sequence_parallel):
    """`dropout` on a block's output: from the default generator, the same mask on every model-parallel rank (the
    tensor is replicated); with sequence parallelism each rank keeps its slice of the whole sequence's mask, so the
    run equals the one without (Megatron-LM draws each slice from the per-rank stream instead)."""
    if not sequence_parallel:
        return dropout(hidden_states)
    return replicated_mask_dropout(hidden_states, dropout.p, dropout.training, sequence_slice=True)


class ParallelMLP(nn.Module):
    """GELU (tanh) MLP h -> f -> h (f = ffn_hidden_size, 4h by default), or with `swiglu` down(silu(gate) * up):
    dense_h_to_4h is then the fused [gate; up] master [2f, h] at stride 2 (rank r: [gate_r; up_r])."""

    def __init__(self, hidden_size, output_dropout_prob, init_method, output_layer_init_method,
                 architecture=GPT2_ARCHITECTURE):
        super().__init__()
        ffn = architecture.ffn_size(hidden_size)
        self.swiglu = architecture.swiglu
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, 2 * ffn if self.swiglu else ffn, gather_output=False,
                                                  init_method=init_method, stride=2 if self.swiglu else 1,
                                                  bias=architecture.add_bias_linear)
        self.dense_4h_to_h = RowParallelLinear(ffn, hidden_size, input_is_parallel=True,
                                               init_method=output_layer_init_method,
                                               bias=architecture.add_bias_linear)
        self.dropout = nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states, layer_past=None, sequence_parallel=False):
        """layer_past: decoding (a LayerPast): only for its weight layouts. sequence_parallel: hidden_states and
        the output are this rank's sequence slice [b, s/p, h]."""
        weight_t = None if layer_past is None else layer_past.weight_t(self.dense_h_to_4h.weight)
        projected = self.dense_h_to_4h(hidden_states, weight_t=weight_t,
                                       sequence_parallel=sequence_parallel)                # [b, s, f/p or 2f/p]
        if self.swiglu:
            gate, up = projected.chunk(2, dim=-1)                                          # 2 x [b, s, f/p]
            intermediate = F.silu(gate) * up
        else:
            intermediate = F.gelu(projected, approximate="tanh")                           # [b, s, f/p]
        output = self.dense_4h_to_h(intermediate, sequence_parallel=sequence_parallel)   # [b, s, h] or [b, s/p, h]
        return hidden_dropout(self.dropout, output, sequence_parallel)


class ParallelTransformerLayer(nn.Module):
    """fused: run training and evaluation forwards through mpu/fused.py's compiled pieces (the same math;
    incremental decoding stays eager). sequence_parallel: the input and output are this rank's sequence slice
    (except while decoding, which runs without sequence parallelism)."""

    def __init__(self, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
                 layernorm_epsilon, init_method, output_layer_init_method, rng_tracker=None, fused=False,
                 architecture=GPT2_ARCHITECTURE, sequence_parallel=False):
        super().__init__()
        if fused and architecture != GPT2_ARCHITECTURE:
            raise ValueError("--torch-compile (fused_compute) runs GPT-2's layers only: drop it, or the Llama options")
        self.fused = fused
        self.sequence_parallel = sequence_parallel
        device = get_device()
        self.input_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device)
        self.attention = ParallelSelfAttention(hidden_size, num_attention_heads, attention_dropout_prob,
                                               output_dropout_prob, init_method, output_layer_init_method,
                                               rng_tracker, architecture)
        self.post_attention_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device)
        if architecture.moe is not None:
            self.mlp = MoEMLP(hidden_size, architecture.ffn_size(hidden_size), architecture.moe, init_method,
                              output_layer_init_method, architecture.swiglu, architecture.add_bias_linear,
                              output_dropout_prob)
        else:
            self.mlp = ParallelMLP(hidden_size, output_dropout_prob, init_method, output_layer_init_method,
                                   architecture)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, rotary=None, sequence_parallel=None):
        """rotary: the (cos, sin) tables of the whole sequence's positions, or None. sequence_parallel: whether
        hidden_states (and the result) are this rank's sequence slice [b, s/p, h]; None: the layer's own setting,
        except while decoding."""
        if self.fused and layer_past is None:
            return self._fused_forward(hidden_states, attention_mask)
        sp = self.sequence_parallel and layer_past is None if sequence_parallel is None else sequence_parallel
        with replicated_gradients_together(self.replicated_parameters() if sp else ()):
            hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states, sequence_parallel=sp),
                                                           attention_mask, layer_past, rotary, sequence_parallel=sp)
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states, sequence_parallel=sp),
                                            layer_past, sequence_parallel=sp)

    def replicated_parameters(self):
        """What sequence parallelism sums over the group: both norms' parameters and the row-parallel biases (LoRA's
        B, used only while the adapter is on, keeps its own all-reduce)."""
        return [param for param in (*self.input_layernorm.parameters(), *self.post_attention_layernorm.parameters(),
                                    self.attention.dense.bias, self.mlp.dense_4h_to_h.bias) if param is not None]

    def _fused_forward(self, hidden_states, attention_mask):
        """The eager forward's math, compiled between the collectives (see mpu/fused.py)."""
        attention, mlp, norm = self.attention, self.mlp, self.post_attention_layernorm
        ln1 = copy_to_model_parallel_region(self.input_layernorm(hidden_states))
        dropout_p = attention.attention_dropout_prob if self.training else 0.0
        with attention.rng_tracker.fork():
            partial = compiled_ops.attention(ln1, attention.query_key_value.weight, attention.query_key_value.bias,
                                             attention.dense.weight, attention_mask, attention.heads_per_partition,
                                             dropout_p)
        hidden_states, ln2 = compiled_ops.bias_dropout_add_layernorm(
            reduce_from_model_parallel_region(partial), attention.dense.bias, hidden_states,
            attention.output_dropout.p, self.training, norm.weight, norm.bias, norm.eps)
        partial = compiled_ops.mlp(copy_to_model_parallel_region(ln2), mlp.dense_h_to_4h.weight,
                                   mlp.dense_h_to_4h.bias, mlp.dense_4h_to_h.weight)
        return compiled_ops.bias_dropout_add(reduce_from_model_parallel_region(partial), mlp.dense_4h_to_h.bias,
                                             hidden_states, mlp.dropout.p, self.training)


def layer_init_shapes(hidden_size, num_attention_heads=1, architecture=GPT2_ARCHITECTURE):
    """The full-size master shapes one ParallelTransformerLayer draws from the default generator, in build order
    (its norms and biases draw nothing): q/k/v, attention output, MLP in, MLP out (an MoE layer: the router, then
    every expert's MLP in and out)."""
    ffn = architecture.ffn_size(hidden_size)
    attention = [(sum(architecture.qkv_rows(hidden_size, num_attention_heads)), hidden_size), (hidden_size, hidden_size)]
    if architecture.moe is not None:
        return attention + moe_init_shapes(hidden_size, ffn, architecture.swiglu, architecture.moe)
    return attention + [((2 if architecture.swiglu else 1) * ffn, hidden_size), (hidden_size, ffn)]


def skip_init_draws(shapes, device):
    """Advance `device`'s default generator exactly as normal_ into fresh fp32 tensors of `shapes` (in order) would,
    keeping none of them: the draws go into one scratch buffer of the largest shape (how much of the stream a draw
    consumes depends on its element count, dtype and device, not on its storage or its mean and std)."""
    if not shapes:
        return
    scratch = torch.empty(max(math.prod(shape) for shape in shapes), dtype=torch.float32, device=device)
    for shape in shapes:
        scratch[:math.prod(shape)].view(shape).normal_()


def pipeline_layer_ranges(num_layers, num_stages, stage, num_chunks=1):
    """[(start, end)] global layer numbers of each model chunk of pipeline stage `stage` (Megatron-LM's
    get_num_layers and offset): chunk c of stage r holds the (c P + r)-th slice of L / (P v) layers, so the model
    runs stage 0, 1, ..., P - 1 on chunk 0, then again on chunk 1, ... Example, L = 8, P = 2, v = 2:

        stage 0: chunk 0 layers 0-1, chunk 1 layers 4-5
        stage 1: chunk 0 layers 2-3, chunk 1 layers 6-7          (v = 1: stage 0 layers 0-3, stage 1 layers 4-7)
    """
    if num_layers % (num_stages * num_chunks):
        raise ValueError(f"num_layers ({num_layers}) is not divisible by the pipeline size ({num_stages}) x model "
                         f"chunks per stage ({num_chunks})")
    per_chunk = num_layers // (num_stages * num_chunks)
    return [((chunk * num_stages + stage) * per_chunk, (chunk * num_stages + stage + 1) * per_chunk)
            for chunk in range(num_chunks)]


class _StageLayers(nn.ModuleList):
    """A pipeline stage's layers, registered under their global numbers (`layers.6...` on the stage holding
    layers 6-11; `layers.{2,3,6,7}` on stage 1 of an interleaved pipeline), so that state-dict and parameter names
    are those of the whole model. Indexed locally."""

    def __init__(self, layers, numbers):
        super().__init__()
        for number, layer in zip(numbers, layers, strict=True):
            self.add_module(str(number), layer)

    def __getitem__(self, index):
        return list(self._modules.values())[index]


class ParallelTransformer(nn.Module):
    """L layers and a final LayerNorm. `recompute` (a RecomputeConfig, mpu/recompute.py) says what backward
    recomputes instead of keeping: nothing, each layer's attention core (selective), or whole layers in checkpointed
    groups (full: uniform groups of num_layers, or the first num_layers layers of the stage, block); a checkpointed
    group keeps only its input. `checkpoint_activations` / `checkpoint_num_layers` are the older spelling of full
    uniform recomputation (pass one or the other); `model.checkpoint_activations = on` still switches it.

    A pipeline stage passes `layer_ranges=[(start, end), ...]` (global layer numbers of each of its model chunks,
    pipeline_layer_ranges; None = all L in one chunk) and `final_layernorm=False` unless it is the last stage.
    Only the stage's layers are built; the other layers' draws are made into a scratch buffer and dropped
    (skip_init_draws), so the default generator runs exactly as for the whole model: each stage's weights equal
    the single-stage model's bitwise, and the generator ends where the whole model leaves it (LoRA's masters and
    dropout come after). Memory: the stage's layers and one layer-sized scratch; time: the whole model's draws.
    forward(..., chunk=c) runs model chunk c (the interleaved schedule's); the final LayerNorm follows the last
    chunk only. Recomputation groups are each chunk's own (block: the first num_layers layers of each chunk, as
    Megatron-LM).

    `fused=True`: every layer's forward runs mpu/fused.py's compiled pieces (--torch-compile); selective
    recomputation needs the eager attention (refused with fused).

    `checkpoint_function(fn, *args)` and `rng_tracker` (the model-parallel dropout stream) default to mpu's; pass
    another pair (zero.checkpointing's) together, so that recomputation replays the tracker it checkpoints. Full
    recomputation uses checkpoint_function; selective always mpu's plain checkpoint (its inputs, q/k/v, hold this
    rank's heads: nothing to partition), replaying the same one tracker."""

    def __init__(self, num_layers, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
                 checkpoint_activations=False, checkpoint_num_layers=1, layernorm_epsilon=1e-5,
                 init_method_std=0.02, checkpoint_function=None, rng_tracker=None, layer_ranges=None,
                 final_layernorm=True, fused=False, recompute=None, architecture=GPT2_ARCHITECTURE,
                 sequence_parallel=False):
        super().__init__()
        if recompute is not None and checkpoint_activations:
            raise ValueError("pass recompute=RecomputeConfig(...) or checkpoint_activations=True, not both")
        if sequence_parallel and fused:
            raise ValueError("sequence parallelism runs the eager layers: drop --torch-compile or --sequence-parallel")
        self.sequence_parallel = sequence_parallel
        self.checkpoint_num_layers = checkpoint_num_layers
        self.checkpoint_function = checkpoint_function if checkpoint_function is not None else mpu_checkpoint
        rng_tracker = rng_tracker if rng_tracker is not None else get_cuda_rng_tracker()
        init_method = init_method_normal(init_method_std)
        output_layer_init_method = scaled_init_method_normal(init_method_std, num_layers)
        layer_ranges = list(layer_ranges) if layer_ranges is not None else [(0, num_layers)]
        self.num_layers = num_layers
        self.numbers = [number for start, end in layer_ranges for number in range(start, end)]
        local = [0]
        for start, end in layer_ranges:
            local.append(local[-1] + end - start)
        self.chunk_bounds = list(zip(local[:-1], local[1:]))   # [(first, end)] local indices of each model chunk
        device = get_device()

        def shapes(first, end):   # what layers first..end-1 draw
            return [shape for number in range(first, end)
                    for shape in layer_init_shapes(hidden_size, num_attention_heads, architecture.for_layer(number))]
        kept, drawn = [], 0
        for start, end in layer_ranges:
            skip_init_draws(shapes(drawn, start), device)  # the layers before this chunk
            kept += [ParallelTransformerLayer(hidden_size, num_attention_heads, attention_dropout_prob,
                                              output_dropout_prob, layernorm_epsilon, init_method,
                                              output_layer_init_method, rng_tracker, fused,
                                              architecture.for_layer(number), sequence_parallel)
                     for number in range(start, end)]
            drawn = end
        skip_init_draws(shapes(drawn, num_layers), device)  # the layers after
        self.layers = nn.ModuleList(kept) if self.numbers == list(range(num_layers)) else \
            _StageLayers(kept, self.numbers)
        self.final_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device) \
            if final_layernorm else None
        self.recompute = recompute if recompute is not None else \
            RecomputeConfig.from_checkpoint_activations(checkpoint_activations, checkpoint_num_layers)

    @property
    def recompute(self):
        """The RecomputeConfig in force (set it to change what the next forwards recompute)."""
        return self._recompute

    @recompute.setter
    def recompute(self, config):
        if config.selective and any(layer.fused for layer in self.layers):
            raise ValueError("selective recomputation checkpoints the eager attention core: it cannot run with the "
                             "fused (compiled) layers (--torch-compile)")
        self._recompute = config
        for layer in self.layers:
            layer.attention.checkpoint_core_attention = config.selective

    @property
    def checkpoint_activations(self):
        """The older switch: whether whole layers are recomputed (full granularity)."""
        return self._recompute.full

    @checkpoint_activations.setter
    def checkpoint_activations(self, on):
        self.recompute = RecomputeConfig.from_checkpoint_activations(on, self.checkpoint_num_layers)

    def numbered_layers(self):
        """[(global layer number, layer)] of this stage's layers."""
        return list(zip(self.numbers, self.layers))

    def set_activation_checkpointing(self, checkpoint_function, rng_tracker):
        """Use another checkpoint function and dropout RNG tracker (a pair: recomputation must replay the
        tracker the checkpoint function captures)."""
        self.checkpoint_function = checkpoint_function
        for layer in self.layers:
            layer.attention.rng_tracker = rng_tracker       # the one user of the per-rank stream

    def _chunk(self, start, end, rotary=None, sequence_parallel=False):
        def run(hidden_states, *mask):
            attention_mask = mask[0] if mask else None
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary=rotary,
                                      sequence_parallel=sequence_parallel)
            return hidden_states
        return run

    def new_inference_cache(self, capacity):
        """An empty InferenceCache for this stack (one slot per layer) of `capacity` positions."""
        return InferenceCache(len(self.layers), capacity)

    def forward(self, hidden_states, attention_mask=None, inference_cache=None, rotary=None,
                sequence_parallel=None, chunk=0):
        """inference_cache: an InferenceCache (see new_inference_cache) to decode incrementally; never
        checkpointed. rotary: the (cos, sin) tables of the whole sequence's positions (mpu.rotary.rotary_tables),
        or None (attention runs on whole sequences, also with sequence parallelism). hidden_states and the result:
        [b, s, h], or this rank's sequence slice [b, s/p, h] with sequence_parallel (not while decoding).
        sequence_parallel: whether this call runs sequence-parallel (None: the stack's setting, except while
        decoding; False: whole sequences, e.g. a length the model-parallel size does not divide). chunk: the model
        chunk to run (interleaved pipeline; 0 otherwise)."""
        if sequence_parallel is None:
            sequence_parallel = self.sequence_parallel and inference_cache is None
        first, end = self.chunk_bounds[chunk]
        if inference_cache is not None:
            for layer, layer_past in zip(self.layers, inference_cache.layers, strict=True):
                hidden_states = layer(hidden_states, attention_mask, layer_past, rotary,
                                      sequence_parallel=sequence_parallel)
        elif self._recompute.full and self.training:
            mask_args = () if attention_mask is None else (attention_mask,)
            for start, stop, checkpointed in self._recompute.layer_chunks(end - first):
                run = self._chunk(first + start, first + stop, rotary, sequence_parallel)
                hidden_states = self.checkpoint_function(run, hidden_states, *mask_args) if checkpointed else \
                    run(hidden_states, *mask_args)
        else:
            for layer in self.layers[first:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary=rotary, sequence_parallel=sequence_parallel)
        if self.final_layernorm is None or chunk != len(self.chunk_bounds) - 1:
            return hidden_states
        return self.final_layernorm(hidden_states, sequence_parallel=sequence_parallel)
