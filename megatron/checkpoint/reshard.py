"""Any-topology checkpoints: a checkpoint of either path (Megatron or ZeRO, any stage), saved at any
model-parallel and data-parallel size, read as full (unsharded) tensors by parameter name, and loaded into a model
of any other topology or path. Files are memory-mapped: a process touches only the tensors it asks for.

    saved = SavedCheckpoint(load_dir)                      # layout, sizes, names (follows tracker / latest)
    saved.full_tensor("word_embeddings.weight")            # [real vocab, h]: the padding rows dropped
    saved.full_tensor(name, "exp_avg")                     # also "exp_avg_sq" and "master" (fp32 masters)
    load_resharded(model, optimizer, lr_scheduler, saved, options)  -> TrainState   (loading.py calls it)
    megatron.checkpoint.full_checkpoint                               # the tools' entry points (zero_to_fp32, HF, resize)

How a parameter is split across model-parallel ranks follows from its name (`partitioning`; a test checks it
against the attributes mpu gives the real parameters):

    word_embeddings.weight, output_layer.weight  rows (dim 0): the vocabulary, padded to the loading run's multiple
    attention.query_key_value.weight/bias/lora_B  rows with stride 3: rank r holds [q_r; k_r; v_r] (with fewer
                                           key/value heads, an mpu.GroupedQKVStride: unequal, maybe replicated)
    mlp.dense_h_to_4h.weight/bias/lora_B   rows (SwiGLU: stride 2, rank r holds [gate_r; up_r])
    attention.dense.weight/lora_A, mlp.dense_4h_to_h.weight/lora_A    columns (dim 1)
    everything else                        replicated (checked equal across the saved ranks; LoRA's lora_A of
                                           the column-parallel linears and lora_B of the row-parallel ones too)
A LoRA checkpoint's frozen parameters are in no optimizer group: their "master" is the weight, their moments None.

Example, query_key_value.weight at mp 2 with h = 2 (rows q0 q1 k0 k1 v0 v1 of the full [3h, h] master):
rank 0 holds [q0, k0, v0], rank 1 holds [q1, k1, v1]; at mp 1 the one rank holds all six in the full order.

Pipeline stages (Megatron layout `mp_rank_{tp:02d}_{pp:03d}/`): each stage's file holds its layers under their
global names, so the stages of one tensor-parallel rank merge into one view of the whole model (the last stage's
LM-head copy of word_embeddings.weight is checked equal to the first stage's and dropped); their optimizer states
are re-indexed into that merged order. A pipelined checkpoint therefore reads like a single-stage one. The ZeRO
layout's stage files (`mp_rank_{tp:02d}_{pp:03d}_model_states.pt`, `zero_pp_rank_{dp}_mp_rank_{tp:02d}_{pp:03d}_...`)
merge the same way; each parameter's optimizer state is read from the flat groups of the stage that holds it (its
param_names say where).
"""
import os
import re

import torch

import mpu
from megatron.checkpoint import atomic_io, deepspeed_format, layout as ckpt
from megatron.checkpoint.stage3_module import tensor_shape
from megatron.train_state import TrainState

_ROW_SPLIT = re.compile(r"(query_key_value|dense_h_to_4h)\.(weight|bias|lora_B)$")
_COLUMN_SPLIT = re.compile(r"(attention\.dense|dense_4h_to_h)\.(weight|lora_A)$")
VOCAB_PARAMETER = "word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"     # the untied LM head: split like the word embedding
OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")


def partitioning(name, model_shape=None):
    """(partition dim or None for replicated, stride, whether the dim is the padded vocabulary) of a GPT2Model
    parameter name; `model_shape` (a checkpoint's MODEL_SHAPE) for the strides of the Llama options."""
    if name.endswith((VOCAB_PARAMETER, OUTPUT_LAYER)):
        return 0, 1, True
    match = _ROW_SPLIT.search(name)
    if match:
        shape = model_shape or {}
        if match.group(1) == "dense_h_to_4h":
            return 0, 2 if shape.get("swiglu") else 1, False
        heads, kv_heads = shape.get("num_attention_heads"), shape.get("num_key_value_heads")
        if kv_heads in (None, heads):
            return 0, 3, False
        head_dim = shape["hidden_size"] // heads
        return 0, mpu.GroupedQKVStride(shape["hidden_size"], head_dim * kv_heads, head_dim), False
    if _COLUMN_SPLIT.search(name):
        return 1, 1, False
    return None, 1, False


def join_shards(shards, dim, stride):
    """The full tensor from the model-parallel shards (inverse of split_full)."""
    if isinstance(stride, mpu.GroupedQKVStride):
        return stride.join(shards, dim)
    pieces = [shard.chunk(stride, dim) for shard in shards]       # pieces[r][j]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim)


def split_full(full, dim, stride, world_size, rank):
    """Rank `rank`'s shard of `full`: cut into world_size x stride blocks, take blocks rank, rank + world, ...
    (grouped-query q/k/v: mpu.GroupedQKVStride's split)"""
    if isinstance(stride, mpu.GroupedQKVStride):
        return stride.split(full, dim, world_size, rank)
    blocks = full.chunk(world_size * stride, dim)
    return torch.cat(blocks[rank::world_size], dim)


def shard_for(name, full, world_size, rank, padded_rows=None, model_shape=None):
    """This rank's shard of the full tensor of parameter `name`; the vocabulary re-padded with zero rows to
    `padded_rows` (the loading model's padded vocabulary)."""
    dim, stride, vocab = partitioning(name, model_shape)
    if vocab and padded_rows is not None and padded_rows != full.shape[0]:
        if padded_rows < full.shape[0]:
            raise ckpt.CheckpointError(f"{name}: the checkpoint's vocabulary ({full.shape[0]}) does not fit this "
                                       f"model's padded vocabulary ({padded_rows})")
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    if dim is None or world_size == 1:
        return full
    if isinstance(stride, mpu.GroupedQKVStride):
        kv_heads = stride.kv_heads
        if (stride.query_rows + 2 * stride.kv_rows != full.shape[dim] or stride.query_rows % world_size
                or (kv_heads % world_size and world_size % kv_heads)):
            raise ckpt.CheckpointError(f"{name}: {kv_heads} key/value heads of size {stride.head_dim} do not split "
                                       f"into {world_size} model-parallel ranks")
    elif full.shape[dim] % (world_size * stride):
        raise ckpt.CheckpointError(f"{name}: size {full.shape[dim]} along dim {dim} does not split into "
                                   f"{world_size} model-parallel ranks x stride {stride}")
    return split_full(full, dim, stride, world_size, rank)


def default_param_names(names):
    """Megatron's optimizer groups by name, for checkpoints saved without ckpt.PARAM_NAMES: weights decay;
    biases and LayerNorm parameters do not (in module order)."""
    no_decay = [n for n in names if n.endswith(".bias") or "layernorm" in n]
    return [[n for n in names if n not in no_decay], no_decay]


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
        self.param_names = first.get(ckpt.PARAM_NAMES) or default_param_names(list(self.weights_of[0]))
        self.zero_stage = first[ckpt.ZERO_STAGE] if self.path == "zero" else None
        self.data_parallel_size = first[ckpt.DATA_PARALLEL_SIZE] if self.path == "zero" else None
        self._optim_files = {}

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
            return _merge_zero_stages(stages, self.directory)
        return _merge_stages(stages, self.directory)

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


def _merge_stage_weights(stage_weights, directory):
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


def _merge_zero_stages(stages, directory):
    """One ZeRO model-states view of one model-parallel rank's stages: the module under global names, each
    optimizer group's param names in stage order (a tied copy once). The optimizer state stays in the stages'
    own files (SavedCheckpoint._zero_shard reads it from the stage holding each parameter). Counters, client
    state (RNG) and lr scheduler: the first stage's."""
    for number, stage in enumerate(stages):
        if stage.get(ckpt.PIPELINE_PARALLEL_SIZE, 1) != len(stages):
            raise ckpt.CheckpointError(f"{directory}: pipeline stage {number}'s model states record pipeline size "
                                       f"{stage.get(ckpt.PIPELINE_PARALLEL_SIZE, 1)}, the directory has "
                                       f"{len(stages)} stages")
    merged = dict(stages[0])
    merged[ckpt.MODULE] = _merge_stage_weights([stage[ckpt.MODULE] for stage in stages], directory)
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


def _merge_stages(stages, directory):
    """One Megatron-path file from the pipeline stages' files of one model-parallel rank: weights under their
    global names, each optimizer group's param names in stage order, the optimizer state re-indexed to that order
    (the last stage's tied LM-head copy dropped). Counters, RNG, lr scheduler and loss scaler: the first stage's."""
    merged = dict(stages[0])
    merged[ckpt.MODEL] = _merge_stage_weights([stage[ckpt.MODEL] for stage in stages], directory)
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
