"""How a GPT2Model parameter is split across model-parallel ranks, by its name (the any-topology reader's rule,
megatron/checkpoint/reshard.py), and the joins and splits that follow from it:

    dim, stride, is_vocab = partitioning("layers.0.attention.query_key_value.weight", model_shape)
    full = join_shards([shard_0, shard_1], dim, stride)          # the saved ranks' shards -> the full tensor
    shard = shard_for(name, full, world_size, rank, padded_rows)  # the full tensor -> this rank's shard

A test checks `partitioning` against the attributes mpu gives the real parameters:

    word_embeddings.weight, output_layer.weight  rows (dim 0): the vocabulary, padded to the loading run's multiple
    attention.query_key_value.weight/bias/lora_B  rows with stride 3: rank r holds [q_r; k_r; v_r] (with fewer
                                           key/value heads, an mpu.GroupedQKVStride: unequal, maybe replicated)
    mlp.dense_h_to_4h.weight/bias/lora_B   rows (SwiGLU: stride 2, rank r holds [gate_r; up_r])
    attention.dense.weight/lora_A, mlp.dense_4h_to_h.weight/lora_A    columns (dim 1)
    everything else                        replicated (checked equal across the saved ranks; LoRA's lora_A of
                                           the column-parallel linears and lora_B of the row-parallel ones too)
A LoRA checkpoint's frozen parameters are in no optimizer group: their "master" is the weight, their moments None.

Example, query_key_value.weight at mp 2 with h = 2 (rows q0 q1 k0 k1 v0 v1 of the full [3h, h] master):
rank 0 holds [q0, k0, v0], rank 1 holds [q1, k1, v1]; at mp 1 the one rank holds all six in the full order.
"""
import re

import torch

import mpu
from megatron.checkpoint import layout as ckpt

_ROW_SPLIT = re.compile(r"(query_key_value|dense_h_to_4h)\.(weight|bias|lora_B)$")
_COLUMN_SPLIT = re.compile(r"(attention\.dense|dense_4h_to_h)\.(weight|lora_A)$")
VOCAB_PARAMETER = "word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"     # the untied LM head: split like the word embedding
OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")


def partitioning(name, model_shape=None):
    """(partition dim or None for replicated, stride, whether the dim is the padded vocabulary) of a GPT2Model
    parameter name; `model_shape` (a checkpoint's MODEL_SHAPE) for the strides of the Llama options."""
    if name.endswith((VOCAB_PARAMETER, OUTPUT_LAYER)):
        return 0, 1, True
    match = _ROW_SPLIT.search(name)
    if match:
        shape = model_shape or {}
        if match.group(1) == "dense_h_to_4h":
            return 0, 2 if shape.get("swiglu") else 1, False
        heads, kv_heads = shape.get("num_attention_heads"), shape.get("num_key_value_heads")
        if kv_heads in (None, heads):
            return 0, 3, False
        head_dim = shape["hidden_size"] // heads
        return 0, mpu.GroupedQKVStride(shape["hidden_size"], head_dim * kv_heads, head_dim), False
    if _COLUMN_SPLIT.search(name):
        return 1, 1, False
    return None, 1, False


def join_shards(shards, dim, stride):
    """The full tensor from the model-parallel shards (inverse of split_full)."""
    if isinstance(stride, mpu.GroupedQKVStride):
        return stride.join(shards, dim)
    pieces = [shard.chunk(stride, dim) for shard in shards]       # pieces[r][j]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim)


def split_full(full, dim, stride, world_size, rank):
    """Rank `rank`'s shard of `full`: cut into world_size x stride blocks, take blocks rank, rank + world, ...
    (grouped-query q/k/v: mpu.GroupedQKVStride's split)"""
    if isinstance(stride, mpu.GroupedQKVStride):
        return stride.split(full, dim, world_size, rank)
    blocks = full.chunk(world_size * stride, dim)
    return torch.cat(blocks[rank::world_size], dim)


def shard_for(name, full, world_size, rank, padded_rows=None, model_shape=None):
    """This rank's shard of the full tensor of parameter `name`; the vocabulary re-padded with zero rows to
    `padded_rows` (the loading model's padded vocabulary)."""
    dim, stride, vocab = partitioning(name, model_shape)
    if vocab and padded_rows is not None and padded_rows != full.shape[0]:
        if padded_rows < full.shape[0]:
            raise ckpt.CheckpointError(f"{name}: the checkpoint's vocabulary ({full.shape[0]}) does not fit this "
                                       f"model's padded vocabulary ({padded_rows})")
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    if dim is None or world_size == 1:
        return full
    if isinstance(stride, mpu.GroupedQKVStride):
        kv_heads = stride.kv_heads
        if (stride.query_rows + 2 * stride.kv_rows != full.shape[dim] or stride.query_rows % world_size
                or (kv_heads % world_size and world_size % kv_heads)):
            raise ckpt.CheckpointError(f"{name}: {kv_heads} key/value heads of size {stride.head_dim} do not split "
                                       f"into {world_size} model-parallel ranks")
    elif full.shape[dim] % (world_size * stride):
        raise ckpt.CheckpointError(f"{name}: size {full.shape[dim]} along dim {dim} does not split into "
                                   f"{world_size} model-parallel ranks x stride {stride}")
    return split_full(full, dim, stride, world_size, rank)


def default_param_names(names):
    """Megatron's optimizer groups by name, for checkpoints saved without ckpt.PARAM_NAMES: weights decay;
    biases and LayerNorm parameters do not (in module order)."""
    no_decay = [n for n in names if n.endswith(".bias") or "layernorm" in n]
    return [[n for n in names if n not in no_decay], no_decay]
