"""DeepSpeed 0.19.8's ZeRO checkpoint contents: read as ours, and written into ours (DESIGN.md section 6).

Both libraries use the same file names (megatron.checkpoint.layout) with different contents. Ours: the model-states
file holds the whole module and our counters; each data-parallel rank's optimizer file holds the unpadded,
contiguous slice [start, end) of every flat param group (layout.GROUPS). DeepSpeed's, for one param group of
parameters a (5 elements) and b (3) at data-parallel size 2:

    stages 1-2  one flat [a a a a a b b b], padded to a multiple of 2 x dp and cut into dp equal partitions:
                rank 0 [a0 a1 a2 a3], rank 1 [a4 b0 b1 b2]; saved without the end padding
                (optimizer_state_dict.single_partition_of_fp32_groups, base_optimizer_state)
    stage 3     every parameter cut on its own into ceil(n / dp) pieces, the last zero-padded; a rank's flat
                is its pieces in order: rank 0 [a0 a1 a2 b0 b1], rank 1 [a3 a4 0 b2 0]
                (optimizer_state_dict.fp32_flat_groups, optimizer_state_dict.optimizer_state_dict); the
                model states are one zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt per rank, holding
                empty tensors for the parameters

Writing (DeepSpeed's keys and layouts added to our files, so DeepSpeed reads them): deepspeed_writing.py, its
functions re-exported here. Reading (load_model_states, load_optim_states): either writer's files as our
contents, so the engine, the any-topology loader and the tools read DeepSpeed's checkpoints as their own. A DeepSpeed stage-3 rank's pieces
are not contiguous in the group: they become several of our slices ("virtual" optimizer files), which every
reader of ours already merges by [start, end).

DeepSpeed pickles three of its classes into its optimizer files (its loss scaler, ZeroStageEnum and
fragment_address) and Megatron-DeepSpeed an argparse.Namespace and numpy's RNG state into its client state.
SAFE_GLOBALS maps each DeepSpeed class to an inert stand-in here (data only, no code), so weights_only loading
reads them without DeepSpeed installed; NUMPY_GLOBALS (numpy's array reconstruction) is allowed for model-states
files only. The stand-ins are written under DeepSpeed's names only into stage-3 optimizer files (whose loader
requires its loss scaler object): plain torch.load(weights_only=True) reads those with
torch.serialization.safe_globals(SAFE_GLOBALS).
"""
import collections
import math
import os

import numpy as np
import torch

from megatron.checkpoint import layout as ckpt
# DeepSpeed's keys (in deepspeed_keys.py; the engine and the tests read them here).
from megatron.checkpoint.deepspeed_keys import (BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, BUFFER_NAMES,
                                                DP_WORLD_SIZE, DS_CONFIG, DS_VERSION, DS_VERSION_KEY, ENGINE_KEYS,
                                                FP32_FLAT_GROUPS, FROZEN_PARAM_FRAGMENTS, FROZEN_PARAM_SHAPES,
                                                GLOBAL_SAMPLES, GROUP_PADDINGS, INNER_OPTIMIZER_STATE, MP_WORLD_SIZE,
                                                OPTIMIZER_STATE_DICT, PARAM_ALIGNMENT_PADDINGS, PARAM_SHAPES,
                                                PARTITION_COUNT, SHARED_PARAMS, SINGLE_PARTITION)  # noqa: F401
# The writer (the engine calls it through this module, its home before the split).
from megatron.checkpoint.deepspeed_writing import (stage12_partition, stage3_pieces, persistent_buffer_names,
                                                   model_states_keys, stage3_model_states, optimizer_state_dict,
                                                   deepspeed_loss_scaler)  # noqa: F401


def is_deepspeed_written(model_states):
    """A model-states dict DeepSpeed wrote (ours carry layout.DATA_PARALLEL_SIZE as well as DeepSpeed's keys)."""
    return ckpt.DATA_PARALLEL_SIZE not in model_states and DP_WORLD_SIZE in model_states


# ---- reading ----------------------------------------------------------------------------------------------------
def model_states_path(directory, model_parallel_rank, pipeline_rank=None):
    """Ours (and DeepSpeed's at stages 1-2), or else DeepSpeed's stage-3 file of data-parallel rank 0."""
    path = os.path.join(directory, ckpt.model_states_name(model_parallel_rank, pipeline_rank))
    stage3 = os.path.join(directory, ckpt.stage3_rank_states_name(0, model_parallel_rank))
    return stage3 if not os.path.isfile(path) and pipeline_rank is None and os.path.isfile(stage3) else path


def load_model_states(directory, model_parallel_rank, pipeline_rank=None):
    """The model-states dict of our layout (layout.MODULE, counters, sizes, PARAM_NAMES, CLIENT_STATE) of this
    rank, memory-mapped; a DeepSpeed-written one translated (its whole module rebuilt at stage 3)."""
    state = _raw_model_states(directory, model_parallel_rank, pipeline_rank)
    if not is_deepspeed_written(state):
        if ckpt.STAGE3_PARTITIONS in state:     # ZeRO-3 saved partitioned: the weights are in the ranks' files
            from megatron.checkpoint.stage3_module import PartitionedModule
            state = {**state, ckpt.MODULE: PartitionedModule(directory, model_parallel_rank, pipeline_rank, state)}
        return state
    return _translated(directory, model_parallel_rank, state).model_states


def load_optim_states(directory, model_parallel_rank, pipeline_rank=None, model_states=None):
    """The optimizer-states dicts of our layout of every saved data-parallel rank (stage 0: rank 0's), or None
    when the checkpoint has none; DeepSpeed-written ones translated. CheckpointError when some are missing."""
    model_states = model_states or load_model_states(directory, model_parallel_rank, pipeline_rank)
    if ckpt.DATA_PARALLEL_SIZE in model_states and not model_states.get(_TRANSLATED):
        return _our_optim_states(directory, model_parallel_rank, pipeline_rank, model_states)
    raw = _raw_model_states(directory, model_parallel_rank, pipeline_rank)
    return _translated(directory, model_parallel_rank, raw).optim_states


def _raw_model_states(directory, model_parallel_rank, pipeline_rank):
    return ckpt.safe_torch_load(model_states_path(directory, model_parallel_rank, pipeline_rank), mmap=True,
                                numpy_arrays=True)


def _our_optim_states(directory, model_parallel_rank, pipeline_rank, model_states):
    found = ckpt.optim_states_ranks(directory, model_parallel_rank, pipeline_rank)
    if not found:
        return None
    # stage 0: rank 0's file holds everything, except under expert parallelism, where the first EP ranks' files
    # hold the different experts
    ranks = list(range(model_states.get(ckpt.EXPERT_MODEL_PARALLEL_SIZE, 1))) if model_states[ckpt.ZERO_STAGE] == 0 \
        else list(range(model_states[ckpt.DATA_PARALLEL_SIZE]))
    missing = sorted(set(ranks) - set(found))
    if missing:
        where = f"model-parallel rank {model_parallel_rank}" + \
            ("" if pipeline_rank is None else f", pipeline stage {pipeline_rank}")
        raise ckpt.CheckpointError(f"{directory}: optimizer-states files of data-parallel ranks {missing} (of "
                                   f"{len(ranks)}; {where}) are missing")
    return [ckpt.safe_torch_load(ckpt.find_optim_states_file(directory, r, model_parallel_rank, pipeline_rank),
                                 mmap=True) for r in ranks]


_TRANSLATED = "translated_from_deepspeed"   # a key of the translated model states (their files are DeepSpeed's)
_cache = {}                                 # (directory, mp rank, file stat) -> _Translation; the last few


class _Translation:
    """One model-parallel rank of a DeepSpeed checkpoint directory in our layout's terms."""

    def __init__(self, directory, model_parallel_rank, state):
        self.directory = directory
        where = f"{directory} (written by DeepSpeed {state.get(DS_VERSION_KEY, '?')})"
        parallel = state.get("checkpoint_parallel_dimensions") or {}
        if parallel.get("pp_degree", 1) != 1:
            raise ckpt.CheckpointError(f"{where}: a DeepSpeed pipeline-parallel checkpoint (layer_* files) is not "
                                       "supported; save it from a data/tensor-parallel run")
        dp = state[DP_WORLD_SIZE]
        paths = [ckpt.find_optim_states_file(directory, r, model_parallel_rank) for r in range(dp)]
        present = [os.path.isfile(path) for path in paths]
        files = [ckpt.safe_torch_load(path, mmap=True) for path, ok in zip(paths, present) if ok]
        if files and not all(present):
            raise ckpt.CheckpointError(f"{where}: optimizer-states files of data-parallel ranks "
                                       f"{[r for r, ok in enumerate(present) if not ok]} (of {dp}) are missing")
        optim = [f[OPTIMIZER_STATE_DICT] for f in files]
        if optim and int(optim[0][ckpt.ZERO_STAGE]) == 3:
            stage = 3
        elif optim:
            stage = int(optim[0][ckpt.ZERO_STAGE])
        else:
            stage = 3 if os.path.basename(model_states_path(directory, model_parallel_rank)).startswith("zero_") \
                else 0
        groups = _group_names(state, optim, stage)
        shapes = {name: torch.Size(shape) for sub in state[PARAM_SHAPES] for name, shape in sub.items()}
        if stage == 3:
            if not optim:
                raise ckpt.CheckpointError(f"{where}: a stage-3 checkpoint without its optimizer-states files has "
                                           "no weights (DeepSpeed keeps them there)")
            self.optim_states, module = _stage3_optim_states(optim, state, groups, shapes, where)
        else:
            module = dict(state[ckpt.MODULE])
            self.optim_states = _stage12_optim_states(optim, groups, shapes, where) if optim else None
        self.model_states = {
            ckpt.MODULE: module, ckpt.LR_SCHEDULER: state.get(ckpt.LR_SCHEDULER),
            ckpt.GLOBAL_STEPS: state[ckpt.GLOBAL_STEPS], ckpt.SKIPPED_STEPS: state.get(ckpt.SKIPPED_STEPS, 0),
            ckpt.MICRO_STEPS: state[ckpt.GLOBAL_STEPS] * _accumulation(state),
            ckpt.CLIENT_STATE: client_state(state), ckpt.MODEL_PARALLEL_SIZE: state.get(MP_WORLD_SIZE, 1),
            ckpt.DATA_PARALLEL_SIZE: len(self.optim_states) if self.optim_states else dp,
            ckpt.PIPELINE_PARALLEL_SIZE: 1, ckpt.ZERO_STAGE: stage,
            ckpt.PARAM_NAMES: [[name for name, _ in group] for group in groups], _TRANSLATED: True,
            DP_WORLD_SIZE: dp}   # the saving data-parallel size (DATA_PARALLEL_SIZE counts the slices at stage 3)


def _translated(directory, model_parallel_rank, state):
    path = model_states_path(directory, model_parallel_rank)
    info = os.stat(path)
    key = (os.path.abspath(directory), model_parallel_rank, info.st_size, info.st_mtime_ns)
    if key not in _cache:
        if len(_cache) >= 4:
            _cache.pop(next(iter(_cache)))
        _cache[key] = _Translation(directory, model_parallel_rank, state)
    return _cache[key]


def _accumulation(state):
    config = state.get(DS_CONFIG) or {}
    return int(config.get("gradient_accumulation_steps", 1)) if isinstance(config, dict) else 1


def _group_names(state, optim, stage):
    """Per param group of the client's optimizer, [(name, shape)] in flat order. DeepSpeed's param_shapes are
    per flat group: a param group at stages 1-2, a sub-group at stage 3 (one param group may have several)."""
    flats = [list(sub.items()) for sub in state[PARAM_SHAPES]]
    if stage != 3 or not optim:
        return flats
    param_groups = optim[0][INNER_OPTIMIZER_STATE]["param_groups"]
    return [[entry for sub in group["params"] for entry in flats[sub]] for group in param_groups]


def _base_state(optim_state, group_index):
    """(per-element state, scalar state, hyperparameters or None) of one group of DeepSpeed's inner optimizer."""
    base = optim_state[BASE_OPTIMIZER_STATE]
    if isinstance(base, dict):        # the torch optimizer's state_dict over the flat partitions
        state = base["state"].get(group_index, {})
        hyper = {k: v for k, v in base["param_groups"][group_index].items() if k != "params"}
    else:                             # elastic_checkpoint: per group, without padding; one step for all
        state, hyper = dict(base[group_index]), None
        if BASE_OPTIMIZER_STATE_STEP in optim_state:
            state["step"] = optim_state[BASE_OPTIMIZER_STATE_STEP]
    slices = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    scalars = {k: v for k, v in state.items() if k not in slices}
    return slices, scalars, hyper


def _stage12_optim_states(optim, groups, shapes, where):
    """One of our optimizer-states dicts per DeepSpeed rank: its partition is already one contiguous slice."""
    for state in optim:
        paddings = state.get(PARAM_ALIGNMENT_PADDINGS) or []
        if any(any(group) for group in paddings):
            raise ckpt.CheckpointError(f"{where}: saved with zero_optimization.parameter_alignment (padding between "
                                       "parameters), which is not supported: save it without")
    result = [_our_optim_dict(optim[0], len(optim), r) for r in range(len(optim))]
    for index, group in enumerate(groups):
        numel = sum(shapes[name].numel() for name, _ in group)
        start = 0
        for rank, state in enumerate(optim):
            master = state[SINGLE_PARTITION][index].reshape(-1)
            slices, scalars, hyper = _base_state(state, index)
            end = start + master.numel()
            result[rank][ckpt.GROUPS].append({
                ckpt.NUMEL: numel, ckpt.START: start, ckpt.END: end, ckpt.MASTER: master,
                ckpt.SLICE_STATE: {k: v.reshape(-1)[:master.numel()] for k, v in slices.items()},
                ckpt.SCALAR_STATE: scalars})
            if rank == 0:
                for saved in result:
                    saved[ckpt.PARAM_GROUPS].append(hyper or {})
            start = end
        if start != numel:
            raise ckpt.CheckpointError(f"{where}: optimizer param group {index}'s partitions hold {start} elements, "
                                       f"its parameters {numel}")
    return result


def _stage3_optim_states(optim, state, groups, shapes, where):
    """Our optimizer-states dicts ("virtual" ranks: piece k of every group) and the whole module, from DeepSpeed's
    per-parameter partitions."""
    dp = len(optim)
    if int(optim[0][PARTITION_COUNT]) != dp:
        raise ckpt.CheckpointError(f"{where}: partition_count {optim[0][PARTITION_COUNT]} but {dp} optimizer files")
    flats = [[flat.reshape(-1) for flat in o[FP32_FLAT_GROUPS]] for o in optim]
    inner = [o[INNER_OPTIMIZER_STATE] for o in optim]
    sub_of_group = [group["params"] for group in inner[0]["param_groups"]]
    pieces_of_group, module_pieces = [], collections.defaultdict(list)
    for index, subs in enumerate(sub_of_group):
        pieces, offset = [], 0
        for sub in subs:
            for rank in range(dp):
                cursor = 0
                moments = {k: v.reshape(-1) for k, v in inner[rank]["state"].get(sub, {}).items()
                           if torch.is_tensor(v) and v.dim() > 0}
                sub_offset = offset
                for name, shape in state[PARAM_SHAPES][sub].items():
                    numel = torch.Size(shape).numel()
                    part = math.ceil(numel / dp)
                    lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
                    piece = slice(cursor, cursor + hi - lo)
                    module_pieces[name].append(flats[rank][sub][piece])
                    if hi > lo:
                        pieces.append((sub_offset + lo, sub_offset + hi, flats[rank][sub][piece],
                                       {k: v[piece] for k, v in moments.items()}))
                    cursor += part
                    sub_offset += numel
                if cursor != flats[rank][sub].numel():
                    raise ckpt.CheckpointError(f"{where}: rank {rank}'s flat group {sub} holds "
                                               f"{flats[rank][sub].numel()} elements, its parameters' pieces {cursor}")
            offset = sub_offset
        pieces_of_group.append(pieces)
    count = max(len(p) for p in pieces_of_group) if pieces_of_group else 0
    result = [_our_optim_dict(optim[0], count, k) for k in range(count)]
    for index, pieces in enumerate(pieces_of_group):
        numel = sum(shapes[name].numel() for name, _ in groups[index])
        _, scalars = _inner_state(inner[0], sub_of_group[index][0])
        hyper = {k: v for k, v in inner[0]["param_groups"][index].items() if k != "params"}
        for k, saved in enumerate(result):
            lo, hi, master, moments = pieces[k] if k < len(pieces) else (0, 0, torch.zeros(0), {})
            saved[ckpt.GROUPS].append({ckpt.NUMEL: numel, ckpt.START: lo, ckpt.END: hi, ckpt.MASTER: master,
                                       ckpt.SLICE_STATE: moments or {key: torch.zeros(0) for key in (pieces[0][3] if pieces else {})},
                                       ckpt.SCALAR_STATE: scalars})
            saved[ckpt.PARAM_GROUPS].append(hyper)
    module = {name: torch.cat(module_pieces[name])[:shape.numel()].view(shape) for name, shape in shapes.items()}
    module.update(_frozen_and_buffers(state))
    return result, module


def _inner_state(inner, sub):
    state = inner["state"].get(sub, {})
    return ({k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0},
            {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)})


def _frozen_and_buffers(state):
    """Stage 3: the buffers (whole in every file). Frozen parameters (a fragment in each rank's model states)
    are refused by name."""
    frozen = state.get(FROZEN_PARAM_SHAPES) or {}
    if frozen:
        raise ckpt.CheckpointError(f"a DeepSpeed stage-3 checkpoint with frozen parameters ({len(frozen)}, e.g. "
                                   f"{next(iter(frozen))}) is not supported: save it with every parameter trainable")
    return {name: state[ckpt.MODULE][name] for name in state.get(BUFFER_NAMES) or () if name in state[ckpt.MODULE]}


def _our_optim_dict(first, size, rank):
    return {ckpt.ZERO_STAGE: int(first[ckpt.ZERO_STAGE]), ckpt.DATA_PARALLEL_SIZE: size,
            ckpt.DATA_PARALLEL_RANK: rank, ckpt.LOSS_SCALER: our_loss_scaler_state(first.get(ckpt.LOSS_SCALER)),
            ckpt.PARAM_GROUPS: [], ckpt.GROUPS: []}


def our_loss_scaler_state(scaler):
    """megatron.fp16.loss_scaler.LossScaler.state_dict() from DeepSpeed's scaler object (static 1.0 when absent)."""
    if scaler is None:
        return {"scale": 1.0, "iteration": 0, "last_overflow_iteration": -1, "hysteresis_left": 1, "dynamic": False}
    attributes = vars(scaler)
    return {"scale": float(attributes.get("cur_scale", 1.0)), "iteration": int(attributes.get("cur_iter", 0)),
            "last_overflow_iteration": int(attributes.get("last_overflow_iter", -1)),
            "hysteresis_left": int(attributes.get("cur_hysteresis", attributes.get("delayed_shift", 1))),
            "dynamic": bool(attributes.get("dynamic", False))}


def client_state(state):
    """DeepSpeed's client state (every key it does not keep for itself, as its load_checkpoint returns), with
    our counters and RNG states added from what Megatron-DeepSpeed writes there: iteration, args (its
    consumed_train_samples, consumed_valid_samples), random_rng_state, np_rng_state, torch_rng_state,
    cuda_rng_state, rng_tracker_states."""
    client = {key: value for key, value in state.items() if key not in ENGINE_KEYS}
    args = client.get("args")

    def counter(name, default):
        value = client.get(name, getattr(args, name, None) if args is not None else None)
        return int(default if value is None else value)
    ours = {ckpt.ITERATION: counter(ckpt.ITERATION, state[ckpt.GLOBAL_STEPS]),
            ckpt.CONSUMED_TRAIN_SAMPLES: counter(ckpt.CONSUMED_TRAIN_SAMPLES, state.get(GLOBAL_SAMPLES, 0)),
            ckpt.CONSUMED_VALID_SAMPLES: counter(ckpt.CONSUMED_VALID_SAMPLES, 0),
            ckpt.SKIPPED_ITERATIONS: counter(ckpt.SKIPPED_ITERATIONS, state.get(ckpt.SKIPPED_STEPS, 0))}
    rng = _megatron_deepspeed_rng(client)
    if rng is not None:
        ours[ckpt.RNG] = rng
    shape = _megatron_deepspeed_model_shape(args, state.get(MP_WORLD_SIZE, 1))
    if shape is not None and ckpt.MODEL_SHAPE not in client:
        ours[ckpt.MODEL_SHAPE] = shape
    return {**client, **ours}


def _megatron_deepspeed_model_shape(args, model_parallel_size):
    """Our MODEL_SHAPE from Megatron-DeepSpeed's args (num_layers, hidden_size, num_attention_heads,
    padded_vocab_size, layernorm_epsilon), or None when they are not all there. The real vocabulary is not
    recorded there: the padded one stands for it."""
    names = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size")
    if args is None or not all(getattr(args, name, None) is not None for name in names):
        return None
    return ckpt.model_shape_record(args.num_layers, args.hidden_size, args.num_attention_heads,
                                   args.padded_vocab_size, model_parallel_size, args.padded_vocab_size,
                                   getattr(args, "layernorm_epsilon", 1e-5))


def _megatron_deepspeed_rng(client):
    """Our RNG state (megatron.checkpoint.rng) from Megatron-DeepSpeed's keys, or None when they are absent."""
    if not all(key in client for key in ("random_rng_state", "np_rng_state", "torch_rng_state")):
        return None
    version, python_state, gauss = client["random_rng_state"]
    name, keys, pos, has_gauss, cached = client["np_rng_state"]
    rng = {"python_version": version, "python": torch.tensor(python_state, dtype=torch.int64),
           "python_gauss": gauss, "torch": client["torch_rng_state"],
           "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if client.get("cuda_rng_state") is not None:
        rng["cuda"] = client["cuda_rng_state"]
    if client.get("rng_tracker_states") is not None:
        rng["tracker"] = client["rng_tracker_states"]
    return rng
