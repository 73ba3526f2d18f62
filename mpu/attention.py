"""Model-parallel self-attention (`ParallelSelfAttention`): a column-parallel q/k/v linear, this rank's heads/p
heads (grouped-query attention: fewer key/value heads, maybe replicated), the core (SDPA, or ring attention across
the context-parallel group; recomputed in backward under selective recomputation), a row-parallel output linear.

Activations are [b, s, h]; with sequence parallelism the input and output are this rank's slice [b, s/p, h] and
the column-parallel linear gathers the sequence (mpu/transformer.py's docstring says how).
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .architecture import GPT2_ARCHITECTURE, hidden_dropout
from .context_parallel import ring_attention
from .initialize import get_context_parallel_world_size, get_model_parallel_world_size
from .layers import ColumnParallelLinear, GroupedQKVStride, RowParallelLinear
from .random import checkpoint as mpu_checkpoint
from .random import get_cuda_rng_tracker
from .rotary import apply_rotary
from .utils import divide


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
        # sequence, so q, k, v (and rotary and the core) cover all s positions. k, v keep their n_kv/p heads.
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
        selective recomputation recomputes). q: [b, heads/p, s, d]; k, v: [b, kv_heads/p, past + s, d] (grouped-
        query attention: key/value head j serves query heads j*group .. (j+1)*group - 1, HF's repeat_kv order,
        never repeated here) -> the context [b, s, h/p]."""
        b, _, s, _ = q.shape
        dropout_p = self.attention_dropout_prob if self.training else 0.0
        gqa = q.size(1) > k.size(1)      # SDPA's kernels read each key/value head for its query group
        if gqa and s == 1 and past > 0 and dropout_p == 0:
            return self._grouped_decode(q, k, v, attention_mask)
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
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=dropout_p,
                                                         enable_gqa=gqa)
            elif past == 0:  # query length == key length: SDPA's own causal mask
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                         enable_gqa=gqa)
            elif s == 1:     # one new token sees every cached key and itself
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
            else:            # all past keys, causal over the s new ones (is_causal would align top-left)
                allowed = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                         enable_gqa=gqa)
        return context.transpose(1, 2).reshape(b, s, self.hidden_size_per_partition)  # [b, s, h/p]

    def _grouped_decode(self, q, k, v, attention_mask):
        """Grouped-query attention of one new token per sequence (decoding, no dropout): kv head j's query group
        becomes its `group` query rows, [b, n_kv/p, group, d] against [b, n_kv/p, past + 1, d], so the cache is
        read in place, never repeated (a repeat copies the whole cache per token), and every kernel that takes a
        mask applies (SDPA's enable_gqa has fewer). The mask row [b|1, 1, 1, t] covers each of the group's rows."""
        b, heads, _, d = q.shape
        kv_heads = k.size(1)
        rows = q.reshape(b, kv_heads, heads // kv_heads, d)      # query head j*group + i -> kv head j, row i
        mask = None if attention_mask is None else ~attention_mask
        context = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)     # [b, n_kv/p, group, d]
        return context.reshape(b, 1, self.hidden_size_per_partition)            # head-major, as transpose(1, 2)
