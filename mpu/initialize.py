"""Model- and data-parallel process groups.

World = mp x dp. Consecutive ranks form a model-parallel group; ranks with the same position inside their
model-parallel group form a data-parallel group. Example, 8 ranks at model-parallel size 2:

    model-parallel groups: [0 1] [2 3] [4 5] [6 7]
    data-parallel groups:  [0 2 4 6] [1 3 5 7]
    rank 5: model-parallel rank 1, data-parallel rank 2
"""
import torch.distributed as dist

_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(model_parallel_size, timeout=None):
    """Build the groups for `model_parallel_size`; torch.distributed must already be initialized. `timeout` (a
    timedelta; None = torch's default for new groups, 30 min on gloo) bounds each collective on these groups.

    Every rank must call this (new_group is collective), in the same order.
    """
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    assert dist.is_initialized(), "torch.distributed must be initialized before mpu.initialize_model_parallel"
    assert _MODEL_PARALLEL_GROUP is None, "model parallel groups are already initialized"
    world_size = dist.get_world_size()
    if model_parallel_size < 1 or world_size % model_parallel_size != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by model-parallel size ({model_parallel_size})")
    rank = dist.get_rank()
    for start in range(0, world_size, model_parallel_size):
        ranks = list(range(start, start + model_parallel_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP = group
    for offset in range(model_parallel_size):
        ranks = list(range(offset, world_size, model_parallel_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group


def model_parallel_is_initialized():
    return _MODEL_PARALLEL_GROUP is not None and _DATA_PARALLEL_GROUP is not None


def get_model_parallel_group():
    assert _MODEL_PARALLEL_GROUP is not None, "model parallel group is not initialized"
    return _MODEL_PARALLEL_GROUP


def get_data_parallel_group():
    assert _DATA_PARALLEL_GROUP is not None, "data parallel group is not initialized"
    return _DATA_PARALLEL_GROUP


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


def get_model_parallel_rank():
    return dist.get_rank(group=get_model_parallel_group())


def get_model_parallel_src_rank():
    """Global rank of model-parallel rank 0 in this rank's model-parallel group."""
    mp = get_model_parallel_world_size()
    return (dist.get_rank() // mp) * mp


def get_data_parallel_world_size():
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank():
    return dist.get_rank(group=get_data_parallel_group())


def destroy_model_parallel():
    """Forget the groups (the process groups themselves die with torch.distributed)."""
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    _MODEL_PARALLEL_GROUP = None
    _DATA_PARALLEL_GROUP = None
