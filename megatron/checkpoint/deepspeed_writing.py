"""DeepSpeed 0.19.8's ZeRO checkpoint contents written by our engine beside its own (megatron/zero/engine.py adds
these to its files, so DeepSpeed's load_checkpoint and zero_to_fp32 read our checkpoints); the layouts are drawn in
megatron/checkpoint/deepspeed_format.py, which re-exports these functions.

    keys = model_states_keys(module, param_names, full_shapes, dp, mp, pp, global_steps, train_batch_size)
    optim = optimizer_state_dict(stage, dp, masters, moments, scalars, hyperparameters, loss_scaler, ...)
    lo, hi, size = stage12_partition(numel, dp, rank)        # stage 3: stage3_pieces(numels, dp, rank)
"""
import collections

import torch

from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.deepspeed_classes import DeepSpeedDynamicLossScaler, DeepSpeedLossScaler
from megatron.checkpoint.deepspeed_keys import (BASE_OPTIMIZER_STATE, BUFFER_NAMES, DP_WORLD_SIZE, DS_CONFIG,
                                                DS_VERSION, DS_VERSION_KEY, FP32_FLAT_GROUPS, FROZEN_PARAM_FRAGMENTS,
                                                FROZEN_PARAM_SHAPES, GLOBAL_SAMPLES, GROUP_PADDINGS,
                                                INNER_OPTIMIZER_STATE, MP_WORLD_SIZE, PARAM_ALIGNMENT_PADDINGS,
                                                PARAM_SHAPES, PARTITION_COUNT, SHARED_PARAMS, SINGLE_PARTITION)


def stage12_partition(numel, dp, rank):
    """DeepSpeed's stage 1-2 partition of a flat group of `numel` elements: (lo, hi, size), (lo, hi) the real
    elements rank `rank` holds, size the partition's length. The flat is padded to a multiple of 2 x dp (its
    nccl_start_alignment_factor), e.g. numel 10, dp 4: padded 16, size 4, rank 2 holds (8, 10) and 2 padding
    elements, rank 3 only padding."""
    align = 2 * dp
    size = -(-numel // align) * align // dp
    return min(rank * size, numel), min((rank + 1) * size, numel), size


def stage3_pieces(numels, dp, rank):
    """DeepSpeed's stage-3 pieces of rank `rank` for parameters of `numels` elements laid out one after another in
    a flat group: [(lo, hi, size)], (lo, hi) the real elements in flat coordinates, size the piece's length in
    the rank's flat (ceil(n / dp): the last pieces zero-padded)."""
    pieces, offset = [], 0
    for numel in numels:
        size = -(-numel // dp)
        pieces.append((offset + min(rank * size, numel), offset + min((rank + 1) * size, numel), size))
        offset += numel
    return pieces


def persistent_buffer_names(module):
    """The buffers module.state_dict() holds (DeepSpeed's buffer_names)."""
    names = []
    for prefix, submodule in module.named_modules():
        for name, buffer in submodule.named_buffers(recurse=False):
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def model_states_keys(module, param_names, full_shapes, data_parallel_size, model_parallel_size, pipeline_size,
                      global_steps, train_batch_size, ds_config=None, frozen_weights=None):
    """DeepSpeed's keys of the model-states file: `param_names` per flat group (flat order), `full_shapes`
    {name: whole shape}, `frozen_weights` {name: whole tensor} of the parameters in no group (stages 1-2)."""
    frozen_weights = frozen_weights or {}
    return {BUFFER_NAMES: persistent_buffer_names(module),
            PARAM_SHAPES: [collections.OrderedDict((n, torch.Size(full_shapes[n])) for n in names)
                           for names in param_names],
            FROZEN_PARAM_SHAPES: collections.OrderedDict((n, torch.Size(t.shape)) for n, t in frozen_weights.items()),
            FROZEN_PARAM_FRAGMENTS: collections.OrderedDict(frozen_weights), SHARED_PARAMS: {},
            "optimizer": None, "data_sampler": None, "random_ltd": None,
            DP_WORLD_SIZE: data_parallel_size, MP_WORLD_SIZE: model_parallel_size,
            GLOBAL_SAMPLES: global_steps * train_batch_size,
            "checkpoint_parallel_dimensions": {"pp_degree": pipeline_size, "tp_degree": model_parallel_size},
            DS_CONFIG: ds_config, DS_VERSION_KEY: DS_VERSION}


def stage3_model_states(module, names_in_groups, model_states, dtype_of):
    """DeepSpeed's per-rank stage-3 model states: the parameters as empty tensors (their values are in the
    optimizer files), the buffers whole, and every other key of `model_states` (ours and DeepSpeed's)."""
    state = {name: torch.empty(0, dtype=dtype_of[name]) for names in names_in_groups for name in names}
    buffers = dict(module.named_buffers())
    state.update({name: buffers[name].detach() for name in model_states[BUFFER_NAMES]})
    return {**model_states, ckpt.MODULE: state}


def optimizer_state_dict(stage, data_parallel_size, masters, moments, scalars, hyperparameters, loss_scaler,
                         group_paddings=None, param_counts=None, clip_grad=0.0):
    """DeepSpeed's optimizer_state_dict of one rank: per group its flat fp32 partition `masters[g]` in
    DeepSpeed's layout (stages 1-2: without the end padding, whose size group_paddings[g] is), `moments[g]`
    {exp_avg, exp_avg_sq} over the padded partition, `scalars[g]` (step), `hyperparameters[g]`;
    `loss_scaler` our megatron.fp16.loss_scaler.LossScaler."""
    inner = {"state": {g: {**scalars[g], **moments[g]} for g in range(len(masters))},
             "param_groups": [{**hyperparameters[g], "params": [g]} for g in range(len(masters))]}
    common = {ckpt.ZERO_STAGE: int(stage), "dynamic_loss_scale": bool(loss_scaler.dynamic), "overflow": False}
    if stage == 3:   # DeepSpeed's stage 3 requires its loss-scaler object (1-2 keep their own when it is absent,
        # so their files stay plain: torch.load(weights_only=True) reads them without SAFE_GLOBALS)
        return {**common, ckpt.LOSS_SCALER: deepspeed_loss_scaler(loss_scaler), PARTITION_COUNT: data_parallel_size,
                INNER_OPTIMIZER_STATE: inner, FP32_FLAT_GROUPS: list(masters)}
    return {**common, "clip_grad": float(clip_grad), BASE_OPTIMIZER_STATE: inner, SINGLE_PARTITION: list(masters),
            GROUP_PADDINGS: list(group_paddings), PARAM_ALIGNMENT_PADDINGS: [[0] * n for n in param_counts],
            PARTITION_COUNT: [data_parallel_size] * len(masters), DS_VERSION_KEY: DS_VERSION}


def deepspeed_loss_scaler(scaler):
    """A stand-in pickled as DeepSpeed's LossScaler / DynamicLossScaler (their attributes), from our
    megatron.fp16.loss_scaler.LossScaler."""
    if not scaler.dynamic:
        return DeepSpeedLossScaler(float(scaler.scale), dynamic=False)
    return DeepSpeedDynamicLossScaler(
        float(scaler.scale), dynamic=True, cur_iter=scaler.iteration, last_overflow_iter=scaler.last_overflow_iteration,
        scale_factor=2.0, scale_window=scaler.window, min_scale=scaler.min_scale, delayed_shift=scaler.hysteresis,
        cur_hysteresis=scaler.hysteresis_left, consecutive_hysteresis=False, raise_error_at_min_scale=True,
        dtype=torch.float16)
