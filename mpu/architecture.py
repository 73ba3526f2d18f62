"""The transformer layer's options and the pieces its blocks share: `Architecture` (GPT-2's defaults, the
Llama-family options, MoE), the norm it names, GPT-2's init methods, and the dropout on a block's output.

Llama-family options: grouped-query attention (fewer key/value heads, each shared by a group of query heads),
SwiGLU MLP, RMSNorm, no biases, another MLP width; rotary embeddings come in as (cos, sin) tables (mpu/rotary.py).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from torch import nn

from .layers import LayerNorm, replicated_mask_dropout, RMSNorm
from .moe import MoEConfig


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


def hidden_dropout(dropout, hidden_states, sequence_parallel):
    """`dropout` on a block's output: from the default generator, the same mask on every model-parallel rank (the
    tensor is replicated); with sequence parallelism each rank keeps its slice of the whole sequence's mask, so the
    run equals the one without (Megatron-LM draws each slice from the per-rank stream instead)."""
    if not sequence_parallel:
        return dropout(hidden_states)
    return replicated_mask_dropout(hidden_states, dropout.p, dropout.training, sequence_slice=True)
