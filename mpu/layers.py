"""Model-parallel layers: the vocabulary-parallel embedding and the column/row-parallel linears.

Every weight is initialized full-size from the default generator (the same on all model-parallel ranks)
and then split, so a model built from one seed is the same at any model-parallel size.

Linear layer Y = X A + b with A of shape [in, out] (torch stores weight = A^T, [out, in]):
    ColumnParallelLinear: A = [A_1 ... A_p] split by columns; rank i computes Y_i = X A_i + b_i.
    RowParallelLinear:    A = [A_1; ...; A_p] split by rows, X = [X_1 ... X_p] split by columns;
                          rank i computes X_i A_i, and Y = sum_i X_i A_i + b (an all-reduce).
A column-parallel linear followed by a row-parallel one (the MLP, attention) needs no communication between.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .initialize import get_model_parallel_rank, get_model_parallel_world_size
from .mappings import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                       reduce_from_model_parallel_region, scatter_to_model_parallel_region)
from .utils import VocabUtility, divide, get_device


def _mark_model_parallel(param, partition_dim, stride):
    param.model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def _initialize_affine_weight(weight, master_shape, partition_dim, init_method, stride=1):
    """Fill `weight` with this rank's slice of a full-size master weight drawn by `init_method`.

    With stride s (fused q/k/v: s=3) the master's partition dimension is cut into s blocks, each block is cut
    into world_size pieces, and rank r takes piece r of every block: [q_r, k_r, v_r].
    """
    world_size = get_model_parallel_world_size()
    if world_size == 1 and weight.dtype == torch.float32:
        with torch.no_grad():   # the same draws as into a master, without a second full-size copy (zero.Init)
            init_method(weight)
        return
    master = torch.empty(master_shape, dtype=torch.float32, device=weight.device)
    init_method(master)
    if world_size == 1:
        with torch.no_grad():
            weight.copy_(master)
        return
    per_partition = weight.size(partition_dim)
    per_stride = divide(per_partition, stride, "partition size / stride")
    pieces = torch.split(master, per_stride, dim=partition_dim)
    rank = get_model_parallel_rank()
    mine = torch.cat(pieces[rank::world_size], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine)


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
    RowParallelLinear); `stride` keeps fused outputs (q/k/v) grouped per rank."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True, init_method=nn.init.xavier_normal_,
                 stride=1, params_dtype=torch.float32):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, get_model_parallel_world_size(),
                                                "ColumnParallelLinear output size / model-parallel size")
        device = get_device()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype,
                                               device=device))
        _mark_model_parallel(self.weight, 0, stride)
        _initialize_affine_weight(self.weight, (output_size, input_size), 0, init_method, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            _mark_model_parallel(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
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

    def forward(self, input_):
        input_parallel = input_ if self.input_is_parallel else scatter_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        output = reduce_from_model_parallel_region(output_parallel)
        if self.bias is not None:
            output = output + self.bias
        return output
