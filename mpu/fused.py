"""The fused compute path (`--torch-compile`): the pure-compute pieces of a transformer layer and of the
vocab-parallel loss, each compiled with torch.compile (inductor), called between the tensor-parallel collectives.

A layer's forward runs as (collectives and the RNG fork stay eager, outside every compiled piece):

    ln1 = input_layernorm(x)                          eager (one kernel already)
    copy_to_model_parallel_region(ln1)                identity forward, all-reduce backward
    partial = attention(ln1, Wqkv, bqkv, Wdense, ...) compiled: qkv + bias, rotary, SDPA (GQA: enable_gqa, k/v
                                                      not repeated), the dense matmul (no bias) (under the
                                                      model-parallel RNG fork: dropout)
    reduce_from_model_parallel_region(partial)        all-reduce
    x, ln2 = bias_dropout_add_norm(...)               compiled: x + dropout(out + b), then LayerNorm or RMSNorm
    copy_to_model_parallel_region(ln2)
    partial = mlp(ln2, W1, b1, W2, swiglu)            compiled: fc1 + bias + GeLU or SwiGLU, the fc2 matmul (no bias)
    reduce_from_model_parallel_region(partial)
    x = bias_dropout_add(out, b2, x)                  compiled

The Llama options (mpu/architecture.py: grouped-query attention, SwiGLU, RMSNorm, no biases; rotary tables passed
in) run through the same pieces; a layer with experts (MoE) does not.

The math is the eager layer's (the bias of a row-parallel linear is added after the all-reduce in both), so
model parallelism, pipeline stages, ZeRO and activation checkpointing see the same tensors. Dropout inside a
compiled piece draws from torch's generator through aten's own random kernels (inductor's `fallback_random`),
so the masks are eager's for the same generator state and a checkpointed recompute replays them.

The loss: `fused_vocab_parallel_cross_entropy` keeps cross_entropy.py's three all-reduces and computes the local
statistics in two compiled passes over the logits (max; exp-sum with the target logit) and the gradient in one,
saving the logits instead of a softmax copy and writing the gradient into them (as Megatron's loss reuses its
softmax buffer): the caller's logits must be dead after the loss (GPT2Model's are: the LM head's matmul does not
save its output). Padded vocabulary columns are masked to -inf inside each pass, as the eager loss excludes them.
"""
import functools

import torch
import torch.nn.functional as F

from .rotary import apply_rotary


def compiled(fn):
    """`fn` compiled with torch.compile on its first call (static shapes; aten's random kernels)."""
    @functools.cache
    def build():
        return torch.compile(fn, dynamic=False, options={"fallback_random": True})

    @functools.wraps(fn)
    def run(*args):
        return build()(*args)
    return run


@compiled
def attention(ln1, qkv_weight, qkv_bias, dense_weight, attention_mask, heads, kv_heads, dropout_p, rotary_cos,
              rotary_sin):
    """[b, s, h] -> this rank's partial dense output [b, s, h] (before the all-reduce and the bias).
    attention_mask: None (causal) or bool [b|1, 1, s, s], True = masked out. qkv_bias: None without biases.
    kv_heads < heads: grouped-query attention (key/value head j serves query heads j * group ...). rotary_cos/sin:
    None, or the tables mpu/rotary.py applies to q and k."""
    b, s, _ = ln1.shape
    qkv = F.linear(ln1, qkv_weight, qkv_bias)                                # [b, s, (n + 2 n_kv) d / p]
    head_dim = qkv.size(-1) // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(b, s, heads, head_dim).transpose(1, 2)                        # [b, n/p, s, d]
    k, v = (t.view(b, s, kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    if rotary_cos is not None:
        q, k = (apply_rotary(t, (rotary_cos, rotary_sin)) for t in (q, k))
    gqa = heads > kv_heads      # k, v keep their kv_heads: SDPA reads each for its query group, no repeat
    if attention_mask is None:
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    else:
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=dropout_p,
                                                 enable_gqa=gqa)
    context = context.transpose(1, 2).reshape(b, s, -1)                      # [b, s, h/p]
    return F.linear(context, dense_weight)


@compiled
def mlp(ln2, fc1_weight, fc1_bias, fc2_weight, swiglu):
    """[b, s, h] -> this rank's partial fc2 output [b, s, h] (before the all-reduce and the bias). swiglu: fc1 is
    [gate; up] and the activation silu(gate) * up, else GeLU (tanh)."""
    projected = F.linear(ln2, fc1_weight, fc1_bias)
    if swiglu:
        gate, up = projected.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, fc2_weight)
    return F.linear(F.gelu(projected, approximate="tanh"), fc2_weight)


def _bias_dropout_add(out, bias, residual, dropout_p, training):
    return residual + F.dropout(out if bias is None else out + bias, p=dropout_p, training=training)


@compiled
def bias_dropout_add(out, bias, residual, dropout_p, training):
    """residual + dropout(out + bias); bias None: no bias."""
    return _bias_dropout_add(out, bias, residual, dropout_p, training)


@compiled
def bias_dropout_add_norm(out, bias, residual, dropout_p, training, norm_weight, norm_bias, eps, rms):
    """(residual + dropout(out + bias), its LayerNorm, or RMSNorm with `rms` (no bias))."""
    hidden = _bias_dropout_add(out, bias, residual, dropout_p, training)
    if rms:
        return hidden, F.rms_norm(hidden, hidden.shape[-1:], norm_weight, eps)
    return hidden, F.layer_norm(hidden, hidden.shape[-1:], norm_weight, norm_bias, eps)


def _real_logits(logits, real):
    """fp32 logits with this rank's padded columns (from `real` on) at -inf: out of the max and the softmax."""
    vocab = torch.arange(logits.size(-1), device=logits.device)
    return logits.float().masked_fill(vocab >= real, float("-inf"))


@compiled
def logits_max(logits, real):
    return _real_logits(logits, real).amax(dim=-1)


@compiled
def target_logit_and_sum_exp(logits, global_max, local_target, outside, real):
    """(shifted logit of the target, 0 where another rank holds it; sum of exp(shifted)) over this rank's slice,
    the padded columns (from `real` on) excluded."""
    shifted = _real_logits(logits, real) - global_max.unsqueeze(-1)
    predicted = torch.gather(shifted, -1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return predicted, shifted.exp().sum(dim=-1)


@compiled
def cross_entropy_grad_(logits, global_max, sum_exp, local_target, outside, grad_output, real):
    """Overwrites `logits` with d loss / d logits = (softmax - one_hot(target)) * grad_output, exactly 0 in the
    padded columns (from `real` on). In place because a fresh tensor of the logits' size costs more than the
    arithmetic (first-touch page faults on the CPU)."""
    softmax = (_real_logits(logits, real) - global_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    vocab = torch.arange(logits.size(-1), device=logits.device)
    one_hot = ((vocab == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)).to(softmax.dtype)
    logits.copy_((softmax - one_hot) * grad_output.unsqueeze(-1))
