"""A checkpoint's pipeline stages merged per tensor-parallel rank (megatron/checkpoint/reshard.py's SavedCheckpoint
calls these when it opens a pipelined checkpoint).

    merged = merge_stages([stage_0_file, stage_1_file], directory)          # Megatron layout: one rank's file
    merged = merge_zero_stages([stage_0_states, stage_1_states], directory) # ZeRO layout: one rank's model states

Pipeline stages (Megatron layout `mp_rank_{tp:02d}_{pp:03d}/`): each stage's file holds its layers under their
global names, so the stages of one tensor-parallel rank merge into one view of the whole model (the last stage's
LM-head copy of word_embeddings.weight is checked equal to the first stage's and dropped); their optimizer states
are re-indexed into that merged order. A pipelined checkpoint therefore reads like a single-stage one. The ZeRO
layout's stage files (`mp_rank_{tp:02d}_{pp:03d}_model_states.pt`, `zero_pp_rank_{dp}_mp_rank_{tp:02d}_{pp:03d}_...`)
merge the same way; each parameter's optimizer state is read from the flat groups of the stage that holds it (its
param_names say where).
"""
import torch

from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.partitioning import default_param_names


def merge_stage_weights(stage_weights, directory):
    """{name: tensor} of every stage, each name once (a tied copy checked equal to the first stage's)."""
    weights = {}
    for number, stage in enumerate(stage_weights):
        for name, tensor in stage.items():
            if name not in weights:
                weights[name] = tensor
            elif not torch.equal(weights[name], tensor):
                raise ckpt.CheckpointError(f"{directory}: {name} differs between pipeline stage {number} and the "
                                           "first stage (the tied copies must be identical)")
    return weights


def merge_zero_stages(stages, directory):
    """One ZeRO model-states view of one model-parallel rank's stages: the module under global names, each
    optimizer group's param names in stage order (a tied copy once). The optimizer state stays in the stages'
    own files (reshard.SavedCheckpoint._zero_shard reads it from the stage holding each parameter). Counters, client
    state (RNG) and lr scheduler: the first stage's."""
    for number, stage in enumerate(stages):
        if stage.get(ckpt.PIPELINE_PARALLEL_SIZE, 1) != len(stages):
            raise ckpt.CheckpointError(f"{directory}: pipeline stage {number}'s model states record pipeline size "
                                       f"{stage.get(ckpt.PIPELINE_PARALLEL_SIZE, 1)}, the directory has "
                                       f"{len(stages)} stages")
    merged = dict(stages[0])
    merged[ckpt.MODULE] = merge_stage_weights([stage[ckpt.MODULE] for stage in stages], directory)
    groups, seen = None, set()
    for stage in stages:
        names = stage.get(ckpt.PARAM_NAMES) or default_param_names(list(stage[ckpt.MODULE]))
        groups = groups or [[] for _ in names]
        if len(names) != len(groups):
            raise ckpt.CheckpointError(f"{directory}: the pipeline stages have different numbers of optimizer "
                                       f"param groups ({len(groups)} and {len(names)})")
        for group_index, group in enumerate(names):
            groups[group_index] += [name for name in group if name not in seen]
            seen.update(group)
    merged[ckpt.PARAM_NAMES] = groups
    return merged


def merge_stages(stages, directory):
    """One Megatron-path file from the pipeline stages' files of one model-parallel rank: weights under their
    global names, each optimizer group's param names in stage order, the optimizer state re-indexed to that order
    (the last stage's tied LM-head copy dropped). Counters, RNG, lr scheduler and loss scaler: the first stage's."""
    merged = dict(stages[0])
    merged[ckpt.MODEL] = merge_stage_weights([stage[ckpt.MODEL] for stage in stages], directory)
    if not all(ckpt.OPTIMIZER in stage for stage in stages):
        return merged
    sources, groups = {}, None          # name -> (its stage's optimizer state dict, its index there)
    for stage in stages:
        names = stage.get(ckpt.PARAM_NAMES) or default_param_names(list(stage[ckpt.MODEL]))
        groups = groups or [[] for _ in names]
        flat = [(group_index, name) for group_index, group in enumerate(names) for name in group]
        for position, (group_index, name) in enumerate(flat):
            if name not in sources:
                sources[name] = (stage[ckpt.OPTIMIZER], position)
                groups[group_index].append(name)
    order = [name for group in groups for name in group]

    def inner(optimizer):
        return optimizer.get("optimizer", optimizer)
    state = {i: inner(sources[n][0])["state"][sources[n][1]] for i, n in enumerate(order)
             if sources[n][1] in inner(sources[n][0])["state"]}
    optimizer = dict(stages[0][ckpt.OPTIMIZER])
    if "optimizer" in optimizer:
        optimizer["optimizer"] = dict(optimizer["optimizer"], state=state)
    else:
        optimizer["state"] = state
    if "fp32_master_params" in optimizer:
        optimizer["fp32_master_params"] = [sources[n][0]["fp32_master_params"][sources[n][1]] for n in order]
    merged[ckpt.OPTIMIZER], merged[ckpt.PARAM_NAMES] = optimizer, groups
    return merged
