"""Tensor-, context-, data-, pipeline- and expert-parallel process groups (Megatron-LM's layout and order tp, cp, dp,
pp; the expert groups split each data-parallel group as mpu/expert_parallel.py draws).

World = pp x dp x cp x mp. Consecutive ranks form a tensor (model)-parallel group; ranks mp apart within a block of
cp x mp form a context-parallel group (each holds two chunks of the sequence: mpu/context_parallel.py); ranks
cp x mp apart within a pipeline stage form a data-parallel group; ranks dp x cp x mp apart form a pipeline.
rank = pipeline rank x (dp x cp x mp) + data-parallel rank x (cp x mp) + context-parallel rank x mp + tp rank.
Gradients are reduced over data x context parallel (`get_data_parallel_group(with_context_parallel=True)`,
DeepSpeed's `get_sequence_data_parallel_group()`): the cp ranks hold the same parameters but different tokens.
At cp = 1 every group below is what it was without context parallelism.

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

Example, 8 ranks at model-parallel size 2, context-parallel size 2 (dp = 2):

    model-parallel groups:             [0 1] [2 3] [4 5] [6 7]
    context-parallel groups:           [0 2] [1 3] [4 6] [5 7]
    data-parallel groups:              [0 4] [1 5] [2 6] [3 7]
    data x context (gradient) groups:  [0 2 4 6] [1 3 5 7]

`get_model_parallel_*` always means tensor parallel (the split of each layer); the pipeline has its own getters.

Interleaved pipeline (Megatron-LM's virtual pipeline, `virtual_pipeline_model_parallel_size` v > 1): each stage
holds v model chunks; the schedule sets the chunk running now with `set_virtual_pipeline_model_parallel_rank`, and
`is_pipeline_first_stage()` / `is_pipeline_last_stage()` then mean the first chunk of stage 0 / the last chunk of
stage P - 1 (`ignore_virtual=True`: the physical stage), as in Megatron-LM's parallel_state.
"""
import torch.distributed as dist

from .expert_parallel import expert_parallel_layout

_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_PIPELINE_GROUP = None
_PIPELINE_RANKS = None       # global ranks of this rank's pipeline, stage order
_EMBEDDING_GROUP = None
_EMBEDDING_RANKS = None
_CONTEXT_PARALLEL_GROUP = None
_CONTEXT_PARALLEL_RANKS = None   # global ranks of this rank's context-parallel group, cp-rank order (the ring)
_DATA_CONTEXT_PARALLEL_GROUP = None
_VIRTUAL_PIPELINE_WORLD_SIZE = None   # model chunks per stage with the interleaved schedule; None: not interleaved
_VIRTUAL_PIPELINE_RANK = None         # the model chunk running now (set by the schedule)
_EXPERT_MODEL_PARALLEL_GROUP = None
_EXPERT_MODEL_PARALLEL_RANKS = None
_EXPERT_DATA_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_RANKS = None


def initialize_model_parallel(model_parallel_size, pipeline_model_parallel_size=1, timeout=None,
                              virtual_pipeline_model_parallel_size=None, context_parallel_size=1):
    """Build the groups for `model_parallel_size` (tensor parallel) x `context_parallel_size` x
    `pipeline_model_parallel_size`;
    torch.distributed must already be initialized. `timeout` (a timedelta; None = torch's default for new
    groups, 30 min on gloo) bounds each collective on these groups. `virtual_pipeline_model_parallel_size`:
    model chunks per stage for the interleaved schedule (None or 1: one chunk, not interleaved).

    Every rank must call this (new_group is collective), in the same order.
    """
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _PIPELINE_GROUP, _PIPELINE_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_RANKS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    global _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_RANKS, _DATA_CONTEXT_PARALLEL_GROUP
    assert dist.is_initialized(), "torch.distributed must be initialized before mpu.initialize_model_parallel"
    assert _MODEL_PARALLEL_GROUP is None, "model parallel groups are already initialized"
    world_size = dist.get_world_size()
    mp, pp, cp = model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if mp < 1 or world_size % mp != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by model-parallel size ({mp})")
    if pp < 1 or cp < 1 or world_size % (mp * cp * pp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by pipeline size ({pp}) x context-parallel "
                         f"size ({cp}) x model-parallel size ({mp}) = {mp * cp * pp}")
    if virtual_pipeline_model_parallel_size not in (None, 1):
        if pp == 1:
            raise ValueError("when interleaved schedule is used, pipeline-model-parallel size should be greater than 1")
        _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK = virtual_pipeline_model_parallel_size, 0
    rank = dist.get_rank()
    stage_size = world_size // pp          # ranks per pipeline stage: dp x cp x mp
    for start in range(0, world_size, mp):
        ranks = list(range(start, start + mp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP = group
    for stage in range(pp):
        for offset in range(mp * cp):      # data parallel: ranks cp x mp apart (at cp = 1: mp apart)
            ranks = list(range(stage * stage_size + offset, (stage + 1) * stage_size, mp * cp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _DATA_PARALLEL_GROUP = group
    if cp > 1:
        _build_context_parallel_groups(rank, world_size, stage_size, mp, cp, timeout)
    else:                                  # no new groups: at cp = 1 the run is the one without context parallelism
        _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_RANKS = None, [rank]
        _DATA_CONTEXT_PARALLEL_GROUP = _DATA_PARALLEL_GROUP
    for position in range(stage_size):
        ranks = list(range(position, world_size, stage_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _PIPELINE_GROUP, _PIPELINE_RANKS = group, ranks
        embedding_ranks = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(embedding_ranks, timeout=timeout)
        if rank in embedding_ranks:
            _EMBEDDING_GROUP, _EMBEDDING_RANKS = group, embedding_ranks


def _build_context_parallel_groups(rank, world_size, stage_size, mp, cp, timeout):
    """The context-parallel groups (ranks mp apart within each block of cp x mp consecutive ranks) and the
    data x context groups gradients are reduced over (ranks mp apart within a pipeline stage)."""
    global _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_RANKS, _DATA_CONTEXT_PARALLEL_GROUP
    for block in range(0, world_size, mp * cp):
        for offset in range(mp):
            ranks = list(range(block + offset, block + mp * cp, mp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_RANKS = group, ranks
    for stage_start in range(0, world_size, stage_size):
        for offset in range(mp):
            ranks = list(range(stage_start + offset, stage_start + stage_size, mp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _DATA_CONTEXT_PARALLEL_GROUP = group


def model_parallel_is_initialized():
    return _MODEL_PARALLEL_GROUP is not None and _DATA_PARALLEL_GROUP is not None


def get_model_parallel_group():
    assert _MODEL_PARALLEL_GROUP is not None, "model parallel group is not initialized"
    return _MODEL_PARALLEL_GROUP


def get_data_parallel_group(with_context_parallel=False):
    """The ranks that read different samples; with_context_parallel: and the context-parallel ranks, which hold
    the same parameters (the group gradients are reduced over; Megatron-LM's argument)."""
    assert _DATA_PARALLEL_GROUP is not None, "data parallel group is not initialized"
    return _DATA_CONTEXT_PARALLEL_GROUP if with_context_parallel else _DATA_PARALLEL_GROUP


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


def get_model_parallel_rank():
    return dist.get_rank(group=get_model_parallel_group())


def get_model_parallel_src_rank():
    """Global rank of model-parallel rank 0 in this rank's model-parallel group."""
    mp = get_model_parallel_world_size()
    return (dist.get_rank() // mp) * mp


def get_data_parallel_world_size(with_context_parallel=False):
    return dist.get_world_size(group=get_data_parallel_group(with_context_parallel))


def get_data_parallel_rank(with_context_parallel=False):
    return dist.get_rank(group=get_data_parallel_group(with_context_parallel))


# DeepSpeed's names for the gradient-reduction group (its engine partitions and reduces over it when the mpu
# object has them; so does megatron.zero's)
def get_sequence_data_parallel_group():
    return get_data_parallel_group(with_context_parallel=True)


def get_sequence_data_parallel_world_size():
    return get_data_parallel_world_size(with_context_parallel=True)


def get_sequence_data_parallel_rank():
    return get_data_parallel_rank(with_context_parallel=True)


# ---------------------------------------------------------------------------------------------------- context

def get_context_parallel_group():
    """This rank's context-parallel group (None at context-parallel size 1: nothing to communicate)."""
    assert _CONTEXT_PARALLEL_RANKS is not None, "context parallel group is not initialized"
    return _CONTEXT_PARALLEL_GROUP


def get_context_parallel_world_size():
    """Context-parallel ranks (1 before initialize_model_parallel)."""
    return len(_CONTEXT_PARALLEL_RANKS) if _CONTEXT_PARALLEL_RANKS is not None else 1


def get_context_parallel_rank():
    """This rank's place in its context-parallel group: it holds sequence chunks rank and 2C - 1 - rank."""
    return _CONTEXT_PARALLEL_RANKS.index(dist.get_rank()) if _CONTEXT_PARALLEL_RANKS is not None else 0


def get_context_parallel_global_ranks():
    """Global ranks of this rank's context-parallel group in cp-rank order (the ring's p2p peers)."""
    assert _CONTEXT_PARALLEL_RANKS is not None, "context parallel group is not initialized"
    return list(_CONTEXT_PARALLEL_RANKS)


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


def initialize_expert_parallel(expert_model_parallel_size, timeout=None):
    """Build the expert groups of every data-parallel group (mpu.initialize_model_parallel first). Collective:
    every rank calls it, in the same order. EP must divide the data-parallel size."""
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS
    global _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS
    assert _EXPERT_MODEL_PARALLEL_RANKS is None, "expert-parallel groups are already initialized"
    ep, dp = expert_model_parallel_size, get_data_parallel_world_size()
    if ep < 1 or dp % ep:
        raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp})")
    # every data-parallel group's ranks, from every rank (new_group must be called for every group everywhere)
    mine = dist.get_process_group_ranks(get_data_parallel_group())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = dist.get_rank()
    for data_parallel_ranks in sorted({tuple(ranks) for ranks in every}):
        model_groups, data_groups = expert_parallel_layout(data_parallel_ranks, ep)
        for ranks in model_groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS = group, ranks
        for ranks in data_groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS = group, ranks


def destroy_expert_parallel():
    """Forget the expert groups (mpu.destroy_model_parallel calls it)."""
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS
    global _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_RANKS
    _EXPERT_MODEL_PARALLEL_GROUP = _EXPERT_MODEL_PARALLEL_RANKS = None
    _EXPERT_DATA_PARALLEL_GROUP = _EXPERT_DATA_PARALLEL_RANKS = None


def get_expert_model_parallel_group():
    """The ranks sharing one MoE layer's experts; None at EP = 1."""
    return _EXPERT_MODEL_PARALLEL_GROUP if get_expert_model_parallel_world_size() > 1 else None


def get_expert_model_parallel_world_size():
    return len(_EXPERT_MODEL_PARALLEL_RANKS) if _EXPERT_MODEL_PARALLEL_RANKS is not None else 1


def get_expert_model_parallel_rank():
    """Which slice of the experts this rank holds (0 at EP = 1)."""
    return _EXPERT_MODEL_PARALLEL_RANKS.index(dist.get_rank()) if _EXPERT_MODEL_PARALLEL_RANKS is not None else 0


def get_expert_data_parallel_group():
    """The ranks holding the same experts (the data-parallel group at EP = 1)."""
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_group()
    return _EXPERT_DATA_PARALLEL_GROUP


def get_expert_data_parallel_world_size():
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_world_size()
    return len(_EXPERT_DATA_PARALLEL_RANKS)


def get_expert_data_parallel_rank():
    if _EXPERT_DATA_PARALLEL_RANKS is None:
        return get_data_parallel_rank()
    return _EXPERT_DATA_PARALLEL_RANKS.index(dist.get_rank())


def destroy_model_parallel():
    """Forget the groups (the process groups themselves die with torch.distributed)."""
    destroy_expert_parallel()
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _PIPELINE_GROUP, _PIPELINE_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_RANKS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    global _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_RANKS, _DATA_CONTEXT_PARALLEL_GROUP
    _CONTEXT_PARALLEL_GROUP = _CONTEXT_PARALLEL_RANKS = _DATA_CONTEXT_PARALLEL_GROUP = None
    _MODEL_PARALLEL_GROUP = None
    _DATA_PARALLEL_GROUP = None
    _PIPELINE_GROUP = _PIPELINE_RANKS = None
    _EMBEDDING_GROUP = _EMBEDDING_RANKS = None
    _VIRTUAL_PIPELINE_WORLD_SIZE = _VIRTUAL_PIPELINE_RANK = None
