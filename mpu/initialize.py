"""Tensor-, data- and pipeline-parallel process groups (Megatron's layout).

World = pp x dp x mp. Consecutive ranks form a tensor (model)-parallel group; ranks at the same position of the
tensor-parallel groups of one pipeline stage form a data-parallel group; ranks dp x mp apart form a pipeline.
rank = pipeline rank x (dp x mp) + data-parallel rank x mp + tensor-parallel rank.

Example, 8 ranks at model-parallel size 2, pipeline size 1 (dp = 4):

    model-parallel groups: [0 1] [2 3] [4 5] [6 7]
    data-parallel groups:  [0 2 4 6] [1 3 5 7]
    rank 5: model-parallel rank 1, data-parallel rank 2

Example, 16 ranks at model-parallel size 2, pipeline size 4 (dp = 2):

    model-parallel groups: [0 1] [2 3] [4 5] [6 7] [8 9] [10 11] [12 13] [14 15]
    data-parallel groups:  [0 2] [1 3] [4 6] [5 7] [8 10] [9 11] [12 14] [13 15]
    pipeline groups:       [0 4 8 12] [1 5 9 13] [2 6 10 14] [3 7 11 15]
    embedding groups:      [0 12] [1 13] [2 14] [3 15]   (first and last stage: the tied word embedding)
    rank 9: model-parallel rank 1, data-parallel rank 0, pipeline rank (stage) 2

`get_model_parallel_*` always means tensor parallel (the split of each layer); the pipeline has its own getters.

Interleaved pipeline (Megatron-LM's virtual pipeline, `virtual_pipeline_model_parallel_size` v > 1): each stage
holds v model chunks; the schedule sets the chunk running now with `set_virtual_pipeline_model_parallel_rank`, and
`is_pipeline_first_stage()` / `is_pipeline_last_stage()` then mean the first chunk of stage 0 / the last chunk of
stage P - 1 (`ignore_virtual=True`: the physical stage), as in Megatron-LM's parallel_state.
"""
import torch.distributed as dist

_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_PIPELINE_GROUP = None
_PIPELINE_RANKS = None       # global ranks of this rank's pipeline, stage order
_EMBEDDING_GROUP = None
_EMBEDDING_RANKS = None
_VIRTUAL_PIPELINE_WORLD_SIZE = None   # model chunks per stage with the interleaved schedule; None: not interleaved
_VIRTUAL_PIPELINE_RANK = None         # the model chunk running now (set by the schedule)


def initialize_model_parallel(model_parallel_size, pipeline_model_parallel_size=1, timeout=None,
                              virtual_pipeline_model_parallel_size=None):
    """Build the groups for `model_parallel_size` (tensor parallel) x `pipeline_model_parallel_size`;
    torch.distributed must already be initialized. `timeout` (a timedelta; None = torch's default for new
    groups, 30 min on gloo) bounds each collective on these groups. `virtual_pipeline_model_parallel_size`:
    model chunks per stage for the interleaved schedule (None or 1: one chunk, not interleaved).

    Every rank must call this (new_group is collective), in the same order.
    """
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _PIPELINE_GROUP, _PIPELINE_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_RANKS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    assert dist.is_initialized(), "torch.distributed must be initialized before mpu.initialize_model_parallel"
    assert _MODEL_PARALLEL_GROUP is None, "model parallel groups are already initialized"
    world_size = dist.get_world_size()
    mp, pp = model_parallel_size, pipeline_model_parallel_size
    if mp < 1 or world_size % mp != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by model-parallel size ({mp})")
    if pp < 1 or world_size % (mp * pp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by pipeline size ({pp}) x model-parallel "
                         f"size ({mp}) = {mp * pp}")
    if virtual_pipeline_model_parallel_size not in (None, 1):
        if pp == 1:
            raise ValueError("when interleaved schedule is used, pipeline-model-parallel size should be greater than 1")
        _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK = virtual_pipeline_model_parallel_size, 0
    rank = dist.get_rank()
    stage_size = world_size // pp          # ranks per pipeline stage: dp x mp
    for start in range(0, world_size, mp):
        ranks = list(range(start, start + mp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP = group
    for stage in range(pp):
        for offset in range(mp):
            ranks = list(range(stage * stage_size + offset, (stage + 1) * stage_size, mp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _DATA_PARALLEL_GROUP = group
    for position in range(stage_size):
        ranks = list(range(position, world_size, stage_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _PIPELINE_GROUP, _PIPELINE_RANKS = group, ranks
        embedding_ranks = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(embedding_ranks, timeout=timeout)
        if rank in embedding_ranks:
            _EMBEDDING_GROUP, _EMBEDDING_RANKS = group, embedding_ranks


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


# ---------------------------------------------------------------------------------------------------- pipeline

def get_pipeline_model_parallel_group():
    assert _PIPELINE_GROUP is not None, "pipeline model parallel group is not initialized"
    return _PIPELINE_GROUP


def get_pipeline_model_parallel_world_size():
    """Pipeline stages (1 before initialize_model_parallel: a model built without groups is one stage)."""
    return len(_PIPELINE_RANKS) if _PIPELINE_RANKS is not None else 1


def get_pipeline_model_parallel_rank():
    """This rank's stage (0 before initialize_model_parallel)."""
    return _PIPELINE_RANKS.index(dist.get_rank()) if _PIPELINE_RANKS is not None else 0


def get_pipeline_model_parallel_ranks():
    """Global ranks of this rank's pipeline, first stage first (p2p sends go to global ranks)."""
    assert _PIPELINE_RANKS is not None, "pipeline model parallel group is not initialized"
    return list(_PIPELINE_RANKS)


def is_pipeline_first_stage(ignore_virtual=False):
    """Stage 0 (interleaved, unless ignore_virtual: and its first model chunk is the one running)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None and _VIRTUAL_PIPELINE_RANK != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=False):
    """Stage P - 1 (interleaved, unless ignore_virtual: and its last model chunk is the one running)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None and \
            _VIRTUAL_PIPELINE_RANK != _VIRTUAL_PIPELINE_WORLD_SIZE - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per stage with the interleaved schedule; None when not interleaved (Megatron-LM's)."""
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def get_virtual_pipeline_model_parallel_rank():
    """The model chunk running now (0 between schedules); None when not interleaved."""
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set by the interleaved schedule before each forward and backward of model chunk `rank`."""
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def get_embedding_group():
    """First and last stage of this rank's pipeline (they hold the word embedding and its tied LM-head copy);
    None on the middle stages."""
    assert _PIPELINE_RANKS is not None, "pipeline model parallel group is not initialized"
    return _EMBEDDING_GROUP


def is_rank_in_embedding_group():
    return _EMBEDDING_RANKS is not None and dist.get_rank() in _EMBEDDING_RANKS


def destroy_model_parallel():
    """Forget the groups (the process groups themselves die with torch.distributed)."""
    from .expert_parallel import destroy_expert_parallel
    destroy_expert_parallel()
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _PIPELINE_GROUP, _PIPELINE_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_RANKS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    _MODEL_PARALLEL_GROUP = None
    _DATA_PARALLEL_GROUP = None
    _PIPELINE_GROUP = _PIPELINE_RANKS = None
    _EMBEDDING_GROUP = _EMBEDDING_RANKS = None
    _VIRTUAL_PIPELINE_WORLD_SIZE = _VIRTUAL_PIPELINE_RANK = None
