"""Broadcast a batch from model-parallel rank 0 to the rest of its model-parallel group."""
import math

import torch
import torch.distributed as dist

from .initialize import (get_model_parallel_group, get_model_parallel_rank, get_model_parallel_src_rank,
                         get_model_parallel_world_size)
from .utils import get_device


def broadcast_data(keys, data, datatype):
    """Return {key: tensor} on every rank of the model-parallel group, taken from its rank 0's `data`.

    Only rank 0 reads `data` (others may pass None). Shapes travel first (one broadcast, read on the host: the
    one host sync), then every tensor flattened into one buffer of `datatype` (a second broadcast). At
    model-parallel size 1 nothing travels: the tensors are copied to the device without waiting (from the
    DataLoader's pinned memory on CUDA).
    """
    device = get_device()
    if get_model_parallel_world_size() == 1:
        for key in keys:
            if data[key].dtype != datatype:
                raise TypeError(f"broadcast_data: {key} has dtype {data[key].dtype}, expected {datatype}")
        return {key: data[key].to(device, non_blocking=True) for key in keys}
    group, src = get_model_parallel_group(), get_model_parallel_src_rank()
    is_src = get_model_parallel_rank() == 0
    max_dims = 8
    shapes = torch.zeros(len(keys), max_dims, dtype=torch.int64, device=device)
    if is_src:
        for i, key in enumerate(keys):
            tensor = data[key]
            if tensor.dtype != datatype:
                raise TypeError(f"broadcast_data: {key} has dtype {tensor.dtype}, expected {datatype}")
            if tensor.dim() > max_dims:
                raise ValueError(f"broadcast_data: {key} has more than {max_dims} dimensions")
            shapes[i, :tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.broadcast(shapes, src, group=group)
    sizes = [[int(d) for d in row if d > 0] for row in shapes.tolist()]
    numels = [math.prod(s) if s else 0 for s in sizes]
    if is_src:
        flat = torch.cat([data[key].reshape(-1).to(device, non_blocking=True) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    output, offset = {}, 0
    for key, size, numel in zip(keys, sizes, numels):
        output[key] = flat[offset:offset + numel].view(size)
        offset += numel
    return output
