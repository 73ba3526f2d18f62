"""Model-parallel layers: the vocabulary-parallel embedding and the column/row-parallel linears.

Every weight is initialized full-size from the default generator (the same on all model-parallel ranks)
and then split, so a model built from one seed is the same at any model-parallel size.

Linear layer Y = X A + b with A of shape [in, out] (torch stores weight = A^T, [out, in]):
    ColumnParallelLinear: A = [A_1 ... A_p] split by columns; rank i computes Y_i = X A_i + b_i.
    RowParallelLinear:    A = [A_1; ...; A_p] split by rows, X = [X_1 ... X_p] split by columns;
                          rank i computes X_i A_i, and Y = sum_i X_i A_i + b (an all-reduce).
A column-parallel linear followed by a row-parallel one (the MLP, attention) needs no communication between.
Sequence parallelism (`forward(..., sequence_parallel=True)`, Megatron-LM's): the column-parallel linear's input is
this rank's sequence slice, all-gathered (backward: reduce-scatter); the row-parallel linear's partial sums are
reduce-scattered into sequence slices (backward: all-gather) and its bias, replicated, is added to the slice, its
gradient summed over the group (see LayerNorm below: the same reason).
Both linears can carry a LoRA adapter (`add_lora`, split along the same dimension: see lora.py).
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .mappings import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                       gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region)
from .mappings import gather_sequence, reduce_scatter_sequence
from .utils import VocabUtility, divide, get_device


@dataclass(frozen=True)
class GroupedQKVStride:
    """The row layout of a fused q/k/v with fewer key/value heads than query heads (grouped-query attention), used
    as a parameter's `partition_stride`. The full master is [q (query_rows); k (kv_rows); v (kv_rows)]; rank r of
    p holds [q_r; k_r; v_r], q_r its 1/p of q. With at least p key/value heads k_r and v_r are their 1/p too;
    with fewer, the heads are replicated: rank r holds the one head its query heads use, head r // (p / kv heads).

        q heads 4, kv heads 2, d = 1:  p = 2: rank 0 [q0 q1 k0 v0], rank 1 [q2 q3 k1 v1]
                                       p = 4: rank 0 [q0 k0 v0], rank 1 [q1 k0 v0], rank 2 [q2 k1 v1], ...
    """
    query_rows: int
    kv_rows: int
    head_dim: int

    @property
    def kv_heads(self):
        return self.kv_rows // self.head_dim

    def replicas(self, world_size):
        """How many ranks hold each key/value head (1: split, not replicated)."""
        return max(1, world_size // self.kv_heads)

    def rows_per_rank(self, world_size):
        kv_piece = self.kv_rows // world_size if self.replicas(world_size) == 1 else self.head_dim
        return self.query_rows // world_size + 2 * kv_piece

    def kv_block(self, world_size):
        """[start, end) of the k and v rows in a rank's piece (the two blocks are adjacent: [q_r; k_r; v_r])."""
        start = self.query_rows // world_size
        return start, self.rows_per_rank(world_size)

    def duplicate_rows(self, world_size, rank):
        """[start, end) of the rows of `rank`'s piece that a lower rank holds too (its replicated k and v heads, on
        every holder but the first), or None. The global gradient norm counts them on the first holder only:
        q heads 4, kv heads 1, d = 1, p = 2: rank 0 [q0 q1 k0 v0] None, rank 1 [q2 q3 k0 v0] (2, 4)."""
        if self.replicas(world_size) == 1 or rank % self.replicas(world_size) == 0:
            return None
        return self.kv_block(world_size)

    def split(self, full, dim, world_size, rank):
        """Rank `rank`'s rows (along `dim`) of the full tensor."""
        q, k, v = full.split([self.query_rows, self.kv_rows, self.kv_rows], dim)
        if self.replicas(world_size) == 1:
            k, v = k.chunk(world_size, dim)[rank], v.chunk(world_size, dim)[rank]
        else:
            start = rank // self.replicas(world_size) * self.head_dim
            k, v = k.narrow(dim, start, self.head_dim), v.narrow(dim, start, self.head_dim)
        return torch.cat([q.chunk(world_size, dim)[rank], k, v], dim)

    def join(self, shards, dim):
        """The full tensor from every rank's rows (a replicated head is read from its first holder)."""
        world_size = len(shards)
        q_piece = self.query_rows // world_size
        kv_piece = (shards[0].size(dim) - q_piece) // 2
        parts = [shard.split([q_piece, kv_piece, kv_piece], dim) for shard in shards]
        owners = range(0, world_size, self.replicas(world_size))
        return torch.cat([part[0] for part in parts] + [parts[r][1] for r in owners] + [parts[r][2] for r in owners],
                         dim)


class _ReplicatedKVGrad:
    """A gradient hook on a fused q/k/v parameter whose key/value heads are replicated (GroupedQKVStride): each
    copy's gradient holds only its rank's query heads' share; replaced by the sum over the ranks holding that head
    (an all-gather of the k/v rows over the model-parallel group), so the copies get the same, whole gradient."""

    def __init__(self, stride, world_size):
        self.stride, self.world_size = stride, world_size

    @classmethod
    def register(cls, param, stride):
        """Hook `param` (rows laid out by `stride`) when its key/value heads are replicated at this size."""
        world_size = get_model_parallel_world_size()
        if param is not None and isinstance(stride, GroupedQKVStride) and stride.replicas(world_size) > 1:
            param.register_hook(cls(stride, world_size))

    def __call__(self, grad):
        q_piece, end = self.stride.kv_block(self.world_size)
        d = (end - q_piece) // 2
        kv = grad.narrow(0, q_piece, 2 * d).contiguous()                          # [2d, ...]: this rank's k, v
        gathered = [torch.empty_like(kv) for _ in range(self.world_size)]
        dist.all_gather(gathered, kv, group=get_model_parallel_group())
        replicas = self.stride.replicas(self.world_size)
        first = get_model_parallel_rank() // replicas * replicas
        grad = grad.clone()
        grad.narrow(0, q_piece, 2 * d).copy_(sum(gathered[first:first + replicas]))
        return grad


def _mark_model_parallel(param, partition_dim, stride):
    param.model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def _initialize_affine_weight(weight, master_shape, partition_dim, init_method, stride=1):
    """Fill `weight` with this rank's slice of a full-size master weight drawn by `init_method`.

    With stride s (fused q/k/v: s=3) the master's partition dimension is cut into s blocks, each block is cut
    into world_size pieces, and rank r takes piece r of every block: [q_r, k_r, v_r]. Grouped-query attention's
    unequal blocks: a GroupedQKVStride.
    """
    if get_model_parallel_world_size() == 1 and weight.dtype == torch.float32:
        with torch.no_grad():   # the same draws as into a master, without a second full-size copy (zero.Init)
            init_method(weight)
        return
    master = torch.empty(master_shape, dtype=torch.float32, device=weight.device)
    init_method(master)
    with torch.no_grad():
        weight.copy_(_split_master(master, partition_dim, weight.size(partition_dim), stride))


def _split_master(master, partition_dim, per_partition, stride=1):
    """This rank's slice (`per_partition` long along `partition_dim`) of a full-size master, with the stride of
    _initialize_affine_weight."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return master
    if isinstance(stride, GroupedQKVStride):
        return stride.split(master, partition_dim, world_size, get_model_parallel_rank())
    per_stride = divide(per_partition, stride, "partition size / stride")
    pieces = torch.split(master, per_stride, dim=partition_dim)
    return torch.cat(pieces[get_model_parallel_rank()::world_size], dim=partition_dim)


def replicated_mask_dropout(input_, p, training, column_slice=False, sequence_slice=False):
    """Dropout with one mask over the full (model-parallel size 1) shape, drawn from the default generator (the same
    on every model-parallel rank), of which this rank keeps its part: `column_slice` (a row-parallel input, this
    rank's columns of the full width) its columns, `sequence_slice` (a sequence-parallel tensor [b, s/p, ...]) its
    positions. The masks are those of model-parallel size 1 and of the run without sequence parallelism, and the
    arithmetic is F.dropout's on the CPU (mask / (1 - p), then input * mask): bitwise its output there. Used by the
    LoRA adapters' dropout and, with sequence parallelism, by the embedding and hidden dropouts."""
    if not training or p == 0.0:
        return input_
    world_size = get_model_parallel_world_size()
    columns = world_size if column_slice else 1
    positions = world_size if sequence_slice else 1
    shape = list(input_.shape)
    shape[-1] *= columns
    shape[1] *= positions                                                   # [b, s, ...]
    keep = torch.empty(shape, dtype=input_.dtype, device=input_.device).bernoulli_(1.0 - p)
    if columns > 1:
        keep = keep.chunk(columns, dim=-1)[get_model_parallel_rank()]
    if positions > 1:
        keep = keep.chunk(positions, dim=1)[get_model_parallel_rank()]
    if columns > 1 or positions > 1:
        keep = keep.clone()          # backward keeps only this rank's part, not a view of the full mask
    return input_ * keep.div_(1.0 - p)


def sequence_parallel_replicated(param):
    """`param` (replicated on every model-parallel rank) as used inside a sequence-parallel region: identity in
    forward, its gradient all-reduced over the model-parallel group in backward. Each rank sees only its slice of
    the sequence, so its gradient is a partial sum (Megatron-LM all-reduces the grads of parameters marked
    `sequence_parallel` after backward; summing here, inside autograd, makes .grad whole before any hook sees it:
    data-parallel reduction, ZeRO's buckets and partitions, the pipeline's embedding sync). Inside
    replicated_gradients_together, the view made for all of a layer's replicated parameters at once."""
    param.sequence_parallel = True
    if _TOGETHER is not None and id(param) in _TOGETHER:
        return _TOGETHER[id(param)]
    return copy_to_model_parallel_region(param)


_TOGETHER = None      # {id(param): its view} inside replicated_gradients_together


class _ReplicatedTogether(torch.autograd.Function):
    """Identity on several replicated parameters; backward sums all their gradients over the model-parallel group
    in one all-reduce of their concatenation (autograd calls it once every output's gradient is ready)."""

    @staticmethod
    def forward(ctx, *params):
        return tuple(param.view_as(param) for param in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=get_model_parallel_group())
        return tuple(piece.view_as(grad) for piece, grad in zip(flat.split([grad.numel() for grad in grads]), grads))


@contextlib.contextmanager
def replicated_gradients_together(params):
    """Within: sequence_parallel_replicated of each of `params` (those that require a gradient, grouped by dtype)
    returns a view from one _ReplicatedTogether, so a layer's LayerNorm weights and biases and row-parallel biases
    (6 for GPT-2) are summed in one all-reduce, not one each. Every one of `params` must be used in the forward
    (an unused one would get a zero gradient instead of None)."""
    global _TOGETHER
    trained = [param for param in params if param.requires_grad]
    if get_model_parallel_world_size() == 1 or not trained or _TOGETHER is not None:
        yield
        return
    views = {}
    for dtype in dict.fromkeys(param.dtype for param in trained):
        group = [param for param in trained if param.dtype == dtype]
        views.update(zip(map(id, group), _ReplicatedTogether.apply(*group)))
    _TOGETHER = views
    try:
        yield
    finally:
        _TOGETHER = None


class _SequenceParallelLinear(torch.autograd.Function):
    """Y = gather(X_slice) A_i + b_i, keeping only X_slice for backward (Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel): backward all-gathers X again for A's
    gradient and reduce-scatters X's. The same math as gather_from_sequence_parallel_region then F.linear, but
    autograd would keep the gathered [b, s, in] (p times the slice)."""

    @staticmethod
    def forward(ctx, input_slice, weight, bias):
        ctx.save_for_backward(input_slice, weight)
        ctx.has_bias = bias is not None
        return F.linear(gather_sequence(input_slice), weight, bias)                 # [b, s, out/p]

    @staticmethod
    def backward(ctx, grad_output):
        input_slice, weight = ctx.saved_tensors
        grad_input = reduce_scatter_sequence(grad_output.matmul(weight))             # [b, s/p, in]
        total = gather_sequence(input_slice) if ctx.needs_input_grad[1] else None    # [b, s, in]
        rows = grad_output.reshape(-1, grad_output.size(-1))                         # [b s, out/p]
        grad_weight = rows.t().matmul(total.reshape(-1, total.size(-1))) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None   # (frozen under LoRA)
        return grad_input, grad_weight, grad_bias


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the same parameters and state-dict names) whose `forward(x, sequence_parallel=True)` takes
    this rank's sequence slice and sums its weight and bias gradients over the model-parallel group."""

    def forward(self, input_, sequence_parallel=False):
        if not sequence_parallel or get_model_parallel_world_size() == 1:
            return super().forward(input_)
        weight = None if self.weight is None else sequence_parallel_replicated(self.weight)
        bias = None if self.bias is None else sequence_parallel_replicated(self.bias)
        return F.layer_norm(input_, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same parameter and state-dict name) whose `forward(x, sequence_parallel=True)` takes this
    rank's sequence slice and sums its weight's gradient over the model-parallel group (as LayerNorm above)."""

    def forward(self, input_, sequence_parallel=False):
        if not sequence_parallel or get_model_parallel_world_size() == 1 or self.weight is None:
            return super().forward(input_)
        return F.rms_norm(input_, self.normalized_shape, sequence_parallel_replicated(self.weight), self.eps)


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary: rank r holds rows [r*V/p, (r+1)*V/p); others' tokens give zeros
    locally, and an all-reduce sums the one nonzero lookup per token."""

    def __init__(self, num_embeddings, embedding_dim, init_method=nn.init.xavier_normal_, params_dtype=torch.float32):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        world_size = get_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_model_parallel_rank(), world_size)
        per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(per_partition, embedding_dim, dtype=params_dtype, device=get_device()))
        _mark_model_parallel(self.weight, 0, 1)
        _initialize_affine_weight(self.weight, (num_embeddings, embedding_dim), 0, init_method)

    def forward(self, input_):
        if get_model_parallel_world_size() == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight)
        output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_model_parallel_region(output_parallel)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns. `gather_output=False` leaves Y_i on rank i (for a following
    RowParallelLinear); `stride` keeps fused outputs (q/k/v, SwiGLU's gate/up) grouped per rank: an int for
    equal blocks, a GroupedQKVStride for grouped-query attention's q/k/v."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True, init_method=nn.init.xavier_normal_,
                 stride=1, params_dtype=torch.float32):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        if isinstance(stride, GroupedQKVStride):
            self.output_size_per_partition = stride.rows_per_rank(get_model_parallel_world_size())
        else:
            self.output_size_per_partition = divide(output_size, get_model_parallel_world_size(),
                                                    "ColumnParallelLinear output size / model-parallel size")
        device = get_device()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype,
                                               device=device))
        self.stride = stride
        _mark_model_parallel(self.weight, 0, stride)
        _initialize_affine_weight(self.weight, (output_size, input_size), 0, init_method, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            _mark_model_parallel(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.lora_disabled = False   # lora.adapters_disabled: the base layer alone
        _ReplicatedKVGrad.register(self.weight, stride)
        _ReplicatedKVGrad.register(self.bias, stride)

    def add_lora(self, lora_a, lora_b, scale, dropout=0.0):
        """A LoRA adapter from full-size masters A [r, in] and B [out, r]: A whole on every rank, B split by rows
        as the weight is (its stride too)."""
        self.lora_A = nn.Parameter(lora_a.detach().clone())
        self.lora_B = nn.Parameter(_split_master(lora_b, 0, self.output_size_per_partition, self.stride).clone())
        _mark_model_parallel(self.lora_B, 0, self.stride)
        _ReplicatedKVGrad.register(self.lora_B, self.stride)
        self.lora_scale, self.lora_dropout = scale, dropout

    def forward(self, input_, weight_t=None, sequence_parallel=False):
        """weight_t: self.weight transposed, contiguous (decoding on CPU: mpu.transformer.decoding_weight_t).
        sequence_parallel: input_ is this rank's sequence slice [b, s/p, in]; the output covers the whole
        sequence [b, s, out/p]."""
        sequence_parallel = sequence_parallel and get_model_parallel_world_size() > 1
        if sequence_parallel and weight_t is None:
            output_parallel = _SequenceParallelLinear.apply(input_, self.weight, self.bias)   # keeps the slice only
        else:
            input_parallel = gather_from_sequence_parallel_region(input_) if sequence_parallel else \
                copy_to_model_parallel_region(input_)
            if weight_t is None:
                output_parallel = F.linear(input_parallel, self.weight, self.bias)
            else:
                output_parallel = torch.matmul(input_parallel, weight_t)
                output_parallel = output_parallel if self.bias is None else output_parallel + self.bias
        if self.lora_A is not None and not self.lora_disabled:
            # u = A x' on every rank, from the input before the copy (whose backward all-reduces the input
            # gradient); this copy's backward sums dL/du over the ranks, so A's gradient is whole on every rank.
            # Sequence parallel: u = A x' of this rank's positions, gathered (backward: dL/du summed over the ranks
            # and cut to my positions), so A's gradient is my positions' share: summed over the group.
            lora_input = replicated_mask_dropout(input_, self.lora_dropout, self.training,
                                                 sequence_slice=sequence_parallel)
            if sequence_parallel:
                u = gather_from_sequence_parallel_region(
                    F.linear(lora_input, sequence_parallel_replicated(self.lora_A)))          # [b, s, r]
            else:
                u = copy_to_model_parallel_region(F.linear(lora_input, self.lora_A))          # [..., r]
            output_parallel = output_parallel + self.lora_scale * F.linear(u, self.lora_B)     # [..., out/p]
        if self.gather_output:
            return gather_from_model_parallel_region(output_parallel)
        return output_parallel


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows. `input_is_parallel=True` takes X_i as already split (the output of a
    ColumnParallelLinear with gather_output=False); the bias is added once, after the all-reduce."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=nn.init.xavier_normal_, params_dtype=torch.float32):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, get_model_parallel_world_size(),
                                               "RowParallelLinear input size / model-parallel size")
        device = get_device()
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype,
                                               device=device))
        _mark_model_parallel(self.weight, 1, 1)
        _initialize_affine_weight(self.weight, (output_size, input_size), 1, init_method)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.lora_disabled = False   # lora.adapters_disabled: the base layer alone

    def add_lora(self, lora_a, lora_b, scale, dropout=0.0):
        """A LoRA adapter from full-size masters A [r, in] and B [out, r]: A split by columns as the weight is,
        B whole on every rank."""
        self.lora_A = nn.Parameter(_split_master(lora_a, 1, self.input_size_per_partition).clone())
        _mark_model_parallel(self.lora_A, 1, 1)
        self.lora_B = nn.Parameter(lora_b.detach().clone())
        self.lora_scale, self.lora_dropout = scale, dropout

    def forward(self, input_, sequence_parallel=False):
        """sequence_parallel: the output is this rank's sequence slice [b, s/p, out] of the summed result."""
        sequence_parallel = sequence_parallel and get_model_parallel_world_size() > 1
        input_parallel = input_ if self.input_is_parallel else scatter_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        # sequence parallel: reduce-scatter (the sum, my positions) instead of all-reduce, [b, s/p, out]
        reduce = reduce_scatter_to_sequence_parallel_region if sequence_parallel else reduce_from_model_parallel_region
        replicated = sequence_parallel_replicated if sequence_parallel else (lambda param: param)
        output = reduce(output_parallel)
        if self.lora_A is not None and not self.lora_disabled:
            # u = sum_i A_i x'_i (an all-reduce of [..., r]); B u is then whole on every rank, as is B's gradient
            # (sequence parallel: u of my positions, B's gradient their share, summed over the group).
            lora_input = replicated_mask_dropout(input_parallel, self.lora_dropout, self.training, column_slice=True)
            u = reduce(F.linear(lora_input, self.lora_A))                                     # [..., r]
            output = output + self.lora_scale * F.linear(u, replicated(self.lora_B))          # [..., out]
        if self.bias is not None:
            output = output + replicated(self.bias)
        return output
