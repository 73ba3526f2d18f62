"""Any-topology checkpoints: a checkpoint of either path (Megatron or ZeRO, any stage), saved at any
model-parallel and data-parallel size, read as full (unsharded) tensors by parameter name, and loaded into a model
of any other topology or path. Files are memory-mapped: a process touches only the tensors it asks for.

    saved = SavedCheckpoint(load_dir)                      # layout, sizes, names (follows tracker / latest)
    saved.full_tensor("word_embeddings.weight")            # [real vocab, h]: the padding rows dropped
    saved.full_tensor(name, "exp_avg")                     # also "exp_avg_sq" and "master" (fp32 masters)
    load_resharded(model, optimizer, lr_scheduler, saved, options)  -> TrainState   (loading.py calls it)
    megatron.checkpoint.full_checkpoint                               # the tools' entry points (zero_to_fp32, HF, resize)

How a parameter is split across model-parallel ranks: megatron/checkpoint/partitioning.py (re-exported here).
How the pipeline stages of a checkpoint merge: megatron/checkpoint/pipeline_stages.py.
"""
import os
import re

import torch

import mpu
from megatron.checkpoint import atomic_io, deepspeed_format, experts, layout as ckpt
from megatron.checkpoint.stage3_module import tensor_shape
from megatron.train_state import TrainState
# How names split (their home before the split; tests, tools and posttrain import them from here too).
from megatron.checkpoint.partitioning import (OPTIMIZER_KINDS, OUTPUT_LAYER, VOCAB_PARAMETER,  # noqa: F401
                                              default_param_names, join_shards, partitioning, shard_for, split_full)
from megatron.checkpoint.pipeline_stages import merge_stages, merge_zero_stages


class SavedCheckpoint:
    """One checkpoint directory of either layout. `path` is 'megatron' or 'zero'."""

    def __init__(self, load_dir, tag=None):
        self.load_dir = load_dir
        self.tag, self.release = tag, tag == ckpt.RELEASE
        if tag is None:
            self.tag, self.release = _tracked_tag(load_dir)
        self.directory = atomic_io.readable_directory(os.path.join(load_dir, self.tag))
        if not os.path.isdir(self.directory):
            raise ckpt.CheckpointError(f"{self.directory} does not exist (named by {load_dir}'s tracker)")
        self.path, ranks, self.pipeline_model_parallel_size = _layout_and_ranks(self.directory)
        self._stage_files = {}            # ZeRO layout under pipelining: mp rank -> its stages' model-states files
        first = self._load_model_file(ranks[0])
        recorded = first[ckpt.MODEL_PARALLEL_SIZE] if self.path == "zero" else \
            (first.get(ckpt.MODEL_SHAPE) or {}).get("model_parallel_size")
        self.model_parallel_size = max(recorded or 0, max(ranks) + 1)
        missing = sorted(set(range(self.model_parallel_size)) - set(ranks))
        if missing:
            raise ckpt.CheckpointError(f"{self.directory}: the shards of model-parallel ranks {missing} are missing "
                                       f"(found {ranks})")
        self.files = [first] + [self._load_model_file(r) for r in range(1, self.model_parallel_size)]
        self.run_state = first[ckpt.CLIENT_STATE] if self.path == "zero" else first
        self.model_shape = self.run_state.get(ckpt.MODEL_SHAPE) or {}
        self.weights_of = [f[ckpt.MODULE] if self.path == "zero" else f[ckpt.MODEL] for f in self.files]
        self.zero_stage = first[ckpt.ZERO_STAGE] if self.path == "zero" else None
        # under expert parallelism (ZeRO only) the saved names are rank 0's: its experts only (experts.py)
        self.expert_model_parallel_size = first.get(ckpt.EXPERT_MODEL_PARALLEL_SIZE, 1) if self.path == "zero" else 1
        self.experts_per_rank = len({experts.expert_number(name) for name in self.weights_of[0]
                                     if experts.is_expert_name(name)}) // self.expert_model_parallel_size
        self.param_names = [self._with_every_expert(names) for names in
                            first.get(ckpt.PARAM_NAMES) or default_param_names(list(self.weights_of[0]))]
        self.data_parallel_size = first[ckpt.DATA_PARALLEL_SIZE] if self.path == "zero" else None
        self._optim_files = {}

    def _with_every_expert(self, names):
        if self.expert_model_parallel_size == 1:
            return names
        return experts.with_every_expert(names, self.expert_model_parallel_size, self.experts_per_rank)

    # ---- description --------------------------------------------------------------------------------------
    def _model_file(self, mp_rank, stage=None):
        if self.path == "zero":
            return os.path.join(self.directory, ckpt.model_states_name(mp_rank, stage))
        return os.path.join(self.directory, ckpt.rank_dir_name(mp_rank, stage), ckpt.CHECKPOINT_FILENAME)

    def _load_model_file(self, mp_rank):
        """One tensor-parallel rank's file; its pipeline stages' files merged into one (memory-mapped)."""
        if self.pipeline_model_parallel_size == 1 and self.path == "zero":   # ours or DeepSpeed's
            return deepspeed_format.load_model_states(self.directory, mp_rank)
        if self.pipeline_model_parallel_size == 1:
            return ckpt.safe_torch_load(self._model_file(mp_rank), mmap=True)
        stages = []
        for stage in range(self.pipeline_model_parallel_size):
            path = self._model_file(mp_rank, stage)
            if not os.path.isfile(path):
                raise ckpt.CheckpointError(f"{self.directory}: {os.path.relpath(path, self.directory)} (pipeline "
                                           f"stage {stage} of model-parallel rank {mp_rank}) is missing")
            stages.append(deepspeed_format.load_model_states(self.directory, mp_rank, stage) if self.path == "zero"
                          else ckpt.safe_torch_load(path, mmap=True))
        if self.path == "zero":
            self._stage_files[mp_rank] = stages
            return merge_zero_stages(stages, self.directory)
        return merge_stages(stages, self.directory)

    def _stage_name(self, stage):
        """The stage as the ZeRO file names carry it: None at P = 1 (names without the stage)."""
        return None if self.pipeline_model_parallel_size == 1 else stage

    def _stage_of_file(self, mp_rank, stage):
        """The model-states dict of (mp rank, stage) as read (ours or DeepSpeed's translated)."""
        return (self._stage_files.get(mp_rank) or [self.files[mp_rank]])[stage]

    def _stage_of(self, mp_rank, name):
        """(stage, its model-states file) holding parameter `name` (the first one: a tied copy is read from the
        first stage); at P = 1 the one file."""
        for stage, state in enumerate(self._stage_files.get(mp_rank) or [self.files[mp_rank]]):
            if name in state[ckpt.MODULE]:
                return stage, state
        raise ckpt.CheckpointError(f"{self.directory}: model-parallel rank {mp_rank} has no parameter {name}")

    def describe(self):
        """'mp2 x pp4 x v2 (megatron)', 'mp1 x pp2 x dp1 (zero-1)': the saving topology (v: model chunks a stage)."""
        stages = f" x pp{self.pipeline_model_parallel_size}" if self.pipeline_model_parallel_size > 1 else ""
        chunks = self.model_shape.get(ckpt.VIRTUAL_PIPELINE_SIZE, 1)
        stages += f" x v{chunks}" if chunks > 1 else ""
        if self.path == "zero":
            saved_dp = self.files[0].get(deepspeed_format.DP_WORLD_SIZE, self.data_parallel_size)
            return f"mp{self.model_parallel_size}{stages} x dp{saved_dp} (zero-{self.zero_stage})"
        return f"mp{self.model_parallel_size}{stages} (megatron)"

    def padded_vocab_size(self):
        weights = self.weights_of[0]
        return tensor_shape(weights, VOCAB_PARAMETER)[0] * self.model_parallel_size if VOCAB_PARAMETER in weights \
            else None

    @property
    def real_vocab_size(self):
        return self.model_shape.get("vocab_size")

    def has_optimizer_state(self):
        if self.path == "zero":
            return bool(ckpt.optim_states_ranks(self.directory, 0, self._stage_name(0)))
        return ckpt.OPTIMIZER in self.files[0]

    # ---- tensors --------------------------------------------------------------------------------------------
    def full_tensor(self, name, kind="weight"):
        """The full tensor of parameter `name` ("weight", or an optimizer kind: "master", "exp_avg",
        "exp_avg_sq"); vocabulary padding rows dropped when the real vocabulary is known. None when the
        checkpoint has no such state."""
        shards = [self._shard(rank, name, kind) for rank in range(self.model_parallel_size)]
        if any(shard is None for shard in shards):
            return None
        dim, stride, vocab = partitioning(name, self.model_shape)
        if dim is None:
            for rank, shard in enumerate(shards[1:], 1):
                if not torch.equal(shard, shards[0]):
                    raise ckpt.CheckpointError(f"{self.directory}: the replicated parameter {name} ({kind}) differs "
                                               f"between model-parallel ranks 0 and {rank}")
            full = shards[0]
        else:
            full = join_shards(shards, dim, stride)
        if vocab and self.real_vocab_size is not None:
            full = full[:self.real_vocab_size]
        return full

    def shard(self, name, kind, world_size, rank, padded_rows=None):
        """Rank `rank`'s (of `world_size`) piece of `name`'s full tensor, read from only the overlapping parts of
        the saved shards; the vocabulary re-padded with zero rows to `padded_rows`. None when not saved."""
        dim, stride, vocab = partitioning(name, self.model_shape)
        if dim is None:
            return self.full_tensor(name, kind)
        saved_world = self.model_parallel_size
        if saved_world == world_size and (not vocab or padded_rows in (None, self.padded_vocab_size())):
            return self._shard(rank, name, kind)
        if isinstance(stride, mpu.GroupedQKVStride):   # grouped-query q/k/v (never the vocabulary): through the full tensor
            full = self.full_tensor(name, kind)
            return None if full is None else split_full(full, dim, stride, world_size, rank)
        shards = [self._shard(q, name, kind) for q in range(saved_world)]
        if any(shard is None for shard in shards):
            return None
        saved_size = shards[0].shape[dim] * saved_world
        limit = min(self.real_vocab_size or saved_size, saved_size) if vocab else saved_size
        target_size = padded_rows if vocab and padded_rows is not None else saved_size
        if vocab and target_size < limit:
            raise ckpt.CheckpointError(f"{name}: the checkpoint's vocabulary ({limit}) does not fit this model's "
                                       f"padded vocabulary ({target_size})")
        if target_size % (world_size * stride) or saved_size % (saved_world * stride):
            raise ckpt.CheckpointError(f"{name}: size {target_size} along dim {dim} does not split into "
                                       f"{world_size} model-parallel ranks x stride {stride}")
        saved_block, target_block = saved_size // stride, target_size // stride   # equal unless vocab (stride 1)
        saved_piece, target_piece = saved_block // saved_world, target_block // world_size
        pieces = []
        for j in range(stride):
            lo, hi = j * target_block + rank * target_piece, j * target_block + (rank + 1) * target_piece
            shape = list(shards[0].shape)
            shape[dim] = hi - lo
            out = shards[0].new_zeros(shape)
            for q, shard in enumerate(shards):
                q_lo = j * saved_block + q * saved_piece
                a, b = max(lo, q_lo), min(hi, q_lo + saved_piece, j * saved_block + limit)
                if a < b:
                    out.narrow(dim, a - lo, b - a).copy_(shard.narrow(dim, j * saved_piece + a - q_lo, b - a))
            pieces.append(out)
        return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]

    def _shard(self, rank, name, kind):
        weights = self.weights_of[rank]
        if name not in weights:
            raise ckpt.CheckpointError(f"{self.directory}: model-parallel rank {rank} has no parameter {name}: the "
                                       "checkpoint is of another model")
        if kind == "weight":
            return weights[name]
        if self.path == "zero":
            return self._zero_shard(rank, name, kind, weights)
        return self._megatron_shard(rank, name, kind, weights)

    def _flat_index(self, name):
        index = 0
        for group_index, names in enumerate(self.param_names):
            if name in names:
                return group_index, index + names.index(name), names.index(name)
            index += len(names)
        raise ckpt.CheckpointError(f"{self.directory}: parameter {name} is in no optimizer param group")

    def _is_frozen(self, name):
        """A LoRA checkpoint's parameter in no optimizer group: a frozen base weight."""
        return any(map(mpu.is_lora_parameter, self.weights_of[0])) and \
            not any(name in names for names in self.param_names)

    def _megatron_shard(self, rank, name, kind, weights):
        optimizer = self.files[rank].get(ckpt.OPTIMIZER)
        if optimizer is None:
            return None
        if self._is_frozen(name):
            return weights[name] if kind == "master" else None
        _, index, _ = self._flat_index(name)
        if kind == "master":
            masters = optimizer.get("fp32_master_params")
            return masters[index] if masters is not None else weights[name].float()
        inner = optimizer.get("optimizer", optimizer)
        return inner["state"].get(index, {}).get(kind)

    def _zero_optim_files(self, rank, stage=0):
        """The optimizer-states files of model-parallel rank `rank` and pipeline stage `stage`, or None."""
        if (rank, stage) not in self._optim_files:
            pp = self._stage_name(stage)
            states = deepspeed_format.load_optim_states(self.directory, rank, pp, self._stage_of_file(rank, stage))
            if states is None and stage > 0 and ckpt.optim_states_ranks(self.directory, rank, self._stage_name(0)):
                raise ckpt.CheckpointError(f"{self.directory}: the optimizer-states files of pipeline stage "
                                           f"{stage} (model-parallel rank {rank}) are missing")
            if states is None:
                return None
            self._optim_files[(rank, stage)] = states
        return self._optim_files[(rank, stage)]

    def _zero_shard(self, rank, name, kind, weights):
        """From the flat groups of the stage holding `name`: that stage's param_names say where it sits."""
        stage, state = self._stage_of(rank, name)
        files = self._zero_optim_files(rank, stage)
        if files is None:
            return None
        weights = state[ckpt.MODULE]
        stage_names = state.get(ckpt.PARAM_NAMES) or default_param_names(list(weights))
        if self.expert_model_parallel_size > 1 and experts.is_expert_name(name):   # in its position's files
            position = experts.expert_number(name) // self.experts_per_rank
            stage_names = [experts.names_at_position(names, position, self.experts_per_rank) for names in stage_names]
            files = experts.files_at_position(files, self.expert_model_parallel_size, position)
        found = [(g, names.index(name)) for g, names in enumerate(stage_names) if name in names]
        if not found and self._is_frozen(name):
            return weights[name] if kind == "master" else None
        if not found:
            raise ckpt.CheckpointError(f"{self.directory}: parameter {name} is in no optimizer param group")
        group_index, position = found[0]
        names = stage_names[group_index]
        start = sum(tensor_shape(weights, n).numel() for n in names[:position])
        shape = tensor_shape(weights, name)
        end = start + shape.numel()
        out = None
        for saved in (f[ckpt.GROUPS][group_index] for f in files):
            source = saved[ckpt.MASTER] if kind == "master" else saved[ckpt.SLICE_STATE].get(kind)
            if source is None:
                return None
            if out is None:
                out = torch.zeros(shape.numel(), dtype=source.dtype)
            lo, hi = max(start, saved[ckpt.START]), min(end, saved[ckpt.END])
            if lo < hi:
                out[lo - start:hi - start] = source[lo - saved[ckpt.START]:hi - saved[ckpt.START]]
        return out.view(shape)

    # ---- the rest of the state ------------------------------------------------------------------------------
    def optimizer_scalars(self, group_index):
        """Per-group scalar optimizer state (Adam's step), or {}."""
        if self.path == "zero":
            files = self._zero_optim_files(0)
            return dict(files[0][ckpt.GROUPS][group_index][ckpt.SCALAR_STATE]) if files else {}
        optimizer = self.files[0].get(ckpt.OPTIMIZER)
        if optimizer is None:
            return {}
        inner = optimizer.get("optimizer", optimizer)
        first = sum(len(names) for names in self.param_names[:group_index])
        state = inner["state"].get(first, {})
        return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}

    def optimizer_hyperparameters(self):
        """The saved param groups' hyperparameters (lr, betas, weight decay, ...), one dict per group."""
        if self.path == "zero":
            files = self._zero_optim_files(0)
            return files[0][ckpt.PARAM_GROUPS] if files else None
        optimizer = self.files[0].get(ckpt.OPTIMIZER)
        inner = optimizer.get("optimizer", optimizer) if optimizer is not None else None
        return None if inner is None else [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]

    def loss_scaler_state(self):
        if self.path == "zero":
            files = self._zero_optim_files(0)
            return files[0][ckpt.LOSS_SCALER] if files else None
        optimizer = self.files[0].get(ckpt.OPTIMIZER)
        return optimizer.get("loss_scaler") if isinstance(optimizer, dict) else None

    def lr_scheduler_state(self):
        return self.files[0].get(ckpt.LR_SCHEDULER)

    def rng_state(self, mp_rank):
        """The RNG states of model-parallel rank `mp_rank` (data-parallel rank 0), or None."""
        if mp_rank >= self.model_parallel_size:
            return None
        state = self.files[mp_rank][ckpt.CLIENT_STATE] if self.path == "zero" else self.files[mp_rank]
        return state.get(ckpt.RNG)

    def train_state(self):
        return TrainState.from_state(self.run_state)


_DEEPSPEED_STAGE3_MODEL_STATES = re.compile(r"zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")


def _layout_and_ranks(directory):
    """(path, sorted model-parallel ranks, pipeline stages)."""
    names = os.listdir(directory)
    stage3 = sorted({int(m.group(1)) for m in map(_DEEPSPEED_STAGE3_MODEL_STATES.match, names) if m})
    if stage3 and not any(map(ckpt.MODEL_STATES_PATTERN.match, names)):   # DeepSpeed's stage-3 files only
        return "zero", stage3, 1
    for path, pattern in (("zero", ckpt.MODEL_STATES_PATTERN), ("megatron", ckpt.RANK_DIR_PATTERN)):
        found = [m for m in map(pattern.match, names) if m]
        staged = [m for m in found if m.group(2) is not None]
        if staged:   # names with the stage exist only at P > 1 (a lost last stage is caught by the recorded size)
            return path, sorted({int(m.group(1)) for m in staged}), max(2, max(int(m.group(2)) for m in staged) + 1)
        if found:
            return path, sorted(int(m.group(1)) for m in found), 1
    raise ckpt.CheckpointError(f"{directory} is not a checkpoint: it holds neither mp_rank_*/"
                               f"{ckpt.CHECKPOINT_FILENAME} nor *_model_states.pt files")


def _tracked_tag(load_dir):
    """(tag, release) named by Megatron's tracker, else by the engine's `latest`."""
    tracked = ckpt.read_tracker(load_dir)
    if tracked is not None:
        iteration, release = tracked
        return os.path.basename(ckpt.checkpoint_dir("", iteration, release)), release
    tag = ckpt.read_latest_tag(load_dir)
    if tag is None:
        raise ckpt.CheckpointError(f"{load_dir} is not a checkpoint directory: it has neither "
                                   f"{ckpt.TRACKER_FILENAME} nor {ckpt.LATEST_FILE}")
    return tag, tag == ckpt.RELEASE
