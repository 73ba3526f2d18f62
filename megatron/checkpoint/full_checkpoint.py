"""The tools' view of a checkpoint: its model as full tensors by name (read_full_checkpoint), and writers of a
checkpoint at any model-parallel size and path from full tensors (write_full_checkpoint for imported weights,
resize_checkpoint for tools/checkpoint_util.py). Reading and splitting are megatron.checkpoint.reshard's, the same code that
loads a checkpoint at another topology during training."""
import os

import torch

from megatron.checkpoint import atomic_io, layout as ckpt
from megatron.checkpoint.stage3_module import tensor_shape
from megatron.checkpoint.reshard import (OPTIMIZER_KINDS, VOCAB_PARAMETER, SavedCheckpoint, default_param_names,
                                         shard_for)


class FullCheckpoint:
    """The model of a checkpoint, whatever its topology: `model_config` (num_layers, hidden_size,
    num_attention_heads, max_sequence_length, vocab_size = the real vocabulary, layernorm_epsilon) and full tensors
    by parameter name."""

    def __init__(self, saved):
        self.saved = saved
        weights = saved.weights_of[0]
        shape = saved.model_shape
        self.model_config = None      # a ZeRO checkpoint of another model (any module the engine trains)
        positions = "position_embeddings.weight" in weights
        if VOCAB_PARAMETER in weights and (positions or shape.get("learned_position_embeddings") is False):
            vocab_shape = tensor_shape(weights, VOCAB_PARAMETER)
            padded = vocab_shape[0] * saved.model_parallel_size
            self.model_config = {
                "num_layers": shape.get("num_layers", _count_layers(weights)),
                "hidden_size": vocab_shape[1],
                "num_attention_heads": shape.get("num_attention_heads"),
                "max_sequence_length": (tensor_shape(weights, "position_embeddings.weight")[0] if positions
                                        else shape.get("max_sequence_length")),
                "vocab_size": saved.real_vocab_size or padded,
                "layernorm_epsilon": shape.get("layernorm_epsilon", 1e-5),
                **ckpt.architecture_record(shape)}

    def require_gpt2(self, what):
        """CheckpointError unless the checkpoint is of our GPT2Model (what `what` needs)."""
        if self.model_config is None:
            names = ", ".join(self.names()[:3])
            raise ckpt.CheckpointError(f"{self.saved.directory} is not a GPT2Model checkpoint (its parameters: "
                                       f"{names}, ...): {what} needs word_embeddings.weight and "
                                       "position_embeddings.weight")
        return self.model_config

    def names(self):
        return list(self.saved.weights_of[0])

    def weights(self):
        return {name: self.saved.full_tensor(name) for name in self.names()}

    def fp32_weights(self, progress=None):
        """The fp32 master weights when the checkpoint has them (mixed precision, ZeRO), else the weights.
        `progress` (a megatron.cli.ProgressLine) counts the tensors read."""
        has_masters = self.saved.has_optimizer_state()
        names = self.names()
        if progress is not None:
            progress.set_total(len(names))
        result = {}
        for name in names:
            result[name] = self.saved.full_tensor(name, "master" if has_masters else "weight").float()
            if progress is not None:
                progress.advance(1, result[name].nbytes)
        return result


def _count_layers(weights):
    return len({name.split(".")[2] for name in weights if name.startswith("transformer.layers.")})


def read_full_checkpoint(load_dir, tag=None):
    return FullCheckpoint(SavedCheckpoint(load_dir, tag))


def write_full_checkpoint(save_dir, weights, model_config, model_parallel_size, deepspeed=False,
                          make_vocab_size_divisible_by=128, progress=None):
    """Write full `weights` (real vocabulary rows) as a 'release' checkpoint at `model_parallel_size` in the Megatron
    layout (or the ZeRO layout with `deepspeed`), weights only: training loads it as --finetune does."""
    return _write_checkpoint(save_dir, ckpt.RELEASE, lambda name: weights[name], list(weights), model_config,
                             model_parallel_size, deepspeed, make_vocab_size_divisible_by, progress=progress)


def resize_checkpoint(saved, save_dir, model_parallel_size, deepspeed, make_vocab_size_divisible_by=128,
                      progress=None):
    """Write `saved` (a SavedCheckpoint) at another model-parallel size and/or path under its own tag: weights,
    counters and lr scheduler; with `deepspeed`, also the fp32 masters, Adam moments and loss scaler (as a
    data-parallel-1 ZeRO checkpoint, which loads at any data-parallel size)."""
    full = FullCheckpoint(saved)
    optimizer = deepspeed and saved.has_optimizer_state()
    tag = saved.tag   # a DeepSpeed tag (global_step3) becomes the directory the tracker names (iter_0000003)
    if not ckpt.ITERATION_DIR_PATTERN.match(tag) and tag != ckpt.RELEASE:
        tag = ckpt.iteration_dir_name(saved.train_state().iteration)
    return _write_checkpoint(save_dir, tag, saved.full_tensor, full.names(), full.require_gpt2("resizing"),
                             model_parallel_size, deepspeed, make_vocab_size_divisible_by,
                             saved=saved, with_optimizer=optimizer, progress=progress)


def _write_checkpoint(save_dir, tag, tensor_of, names, model_config, model_parallel_size, deepspeed,
                      make_vocab_size_divisible_by, saved=None, with_optimizer=False, progress=None):
    """`progress` (a megatron.cli.ProgressLine) counts the shards written: per rank every weight, and with the
    optimizer also its OPTIMIZER_KINDS."""
    from megatron.tokenizer.tokenizer import vocab_size_with_padding
    vocab = model_config["vocab_size"]
    padded = vocab_size_with_padding(vocab, make_vocab_size_divisible_by, model_parallel_size)
    shape = ckpt.model_shape_record(model_config["num_layers"], model_config["hidden_size"],
                                    model_config["num_attention_heads"], padded, model_parallel_size, vocab,
                                    model_config.get("layernorm_epsilon", 1e-5),
                                    architecture=ckpt.architecture_record(model_config),
                                    max_sequence_length=model_config.get("max_sequence_length"))
    run_state = {ckpt.ITERATION: 0, ckpt.MODEL_SHAPE: shape}
    if saved is not None:
        run_state.update(saved.train_state().to_state())

    if progress is not None:
        progress.set_total(model_parallel_size * len(names) * (1 + (len(OPTIMIZER_KINDS) if with_optimizer else 0)))

    def write(directory):
        entries = []      # the manifest entries of the files written
        for rank in range(model_parallel_size):
            def shard(name, kind="weight"):
                full = tensor_of(name) if kind == "weight" else saved.full_tensor(name, kind)
                result = shard_for(name, full, model_parallel_size, rank, padded,
                                   shape).contiguous().clone()
                if progress is not None:
                    progress.advance(1, result.nbytes)
                return result
            shards = {name: shard(name) for name in names}
            rank_state = {**run_state, **_rng_for(saved, rank, model_parallel_size)}
            if deepspeed:
                state = {ckpt.MODULE: shards, ckpt.LR_SCHEDULER: saved.lr_scheduler_state() if saved else None,
                         ckpt.GLOBAL_STEPS: run_state[ckpt.ITERATION],
                         ckpt.SKIPPED_STEPS: run_state.get(ckpt.SKIPPED_ITERATIONS, 0), ckpt.MICRO_STEPS: 0,
                         ckpt.CLIENT_STATE: rank_state, ckpt.DATA_PARALLEL_SIZE: 1,
                         ckpt.MODEL_PARALLEL_SIZE: model_parallel_size, ckpt.ZERO_STAGE: 2,
                         ckpt.PARAM_NAMES: saved.param_names if saved else default_param_names(names)}
                entries.append(ckpt.atomic_torch_save(state, os.path.join(directory, ckpt.model_states_name(rank))))
                if with_optimizer:
                    entries.append(ckpt.atomic_torch_save(_zero_optimizer_file(saved, shard, shards),
                                                          os.path.join(directory, ckpt.optim_states_name(0, rank))))
            else:
                state = {ckpt.MODEL: shards, **rank_state}
                if saved is not None and saved.lr_scheduler_state() is not None:
                    state[ckpt.LR_SCHEDULER] = saved.lr_scheduler_state()
                path = os.path.join(directory, ckpt.rank_dir_name(rank), ckpt.CHECKPOINT_FILENAME)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                entries.append(ckpt.atomic_torch_save(state, path))
        return entries

    def commit():
        if deepspeed:
            ckpt.write_latest_tag(save_dir, tag)
        ckpt.write_tracker(save_dir, run_state[ckpt.ITERATION], release=tag == ckpt.RELEASE)
    final_dir = os.path.join(save_dir, tag)
    atomic_io.save_directory_atomically(final_dir, write, commit, torch.device("cpu"), is_rank_0=True,
                                        error_class=ckpt.CheckpointError)
    return final_dir


def _rng_for(saved, rank, model_parallel_size):
    """{RNG: states} for model-parallel rank `rank`: the saved rank's at the same size; at another size, rank 0's
    default generators without the model-parallel tracker (the loading run keeps its seeded one)."""
    if saved is None or saved.rng_state(0) is None:
        return {}
    if model_parallel_size == saved.model_parallel_size:
        return {ckpt.RNG: saved.rng_state(rank)}
    return {ckpt.RNG: {k: v for k, v in saved.rng_state(0).items() if k != "tracker"}}


def _zero_optimizer_file(saved, shard, weights):
    """A data-parallel-1 ZeRO optimizer-states file: per param group the flat fp32 master and moments of this
    model-parallel rank's shards, in the group's order."""
    groups = []
    for index, names in enumerate(saved.param_names):
        flats = {kind: torch.cat([shard(name, kind).float().reshape(-1) for name in names])
                 if names else torch.zeros(0) for kind in OPTIMIZER_KINDS}
        numel = sum(weights[name].numel() for name in names)
        groups.append({ckpt.NUMEL: numel, ckpt.START: 0, ckpt.END: numel, ckpt.MASTER: flats["master"],
                       ckpt.SLICE_STATE: {k: flats[k] for k in ("exp_avg", "exp_avg_sq")},
                       ckpt.SCALAR_STATE: saved.optimizer_scalars(index)})
    from megatron.fp16.loss_scaler import LossScaler, LossScalerConfig
    scaler = saved.loss_scaler_state() or LossScaler(LossScalerConfig(loss_scale=1.0)).state_dict()
    return {ckpt.ZERO_STAGE: 2, ckpt.DATA_PARALLEL_SIZE: 1, ckpt.DATA_PARALLEL_RANK: 0, ckpt.LOSS_SCALER: scaler,
            ckpt.PARAM_GROUPS: saved.optimizer_hyperparameters() or [{} for _ in groups], ckpt.GROUPS: groups}
