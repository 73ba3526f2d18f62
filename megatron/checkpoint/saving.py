"""Saving a checkpoint, both paths (DESIGN.md section 6; the layouts: megatron.checkpoint.layout).

Megatron path: data-parallel rank 0 of each model-parallel rank writes SAVE/iter_XXXXXXX/mp_rank_XX[_XXX]/
model_optim_rng.pt. ZeRO path (a model with DeepSpeed's engine API, --deepspeed): the engine writes its files
and `latest` under the iteration's tag; save_ds_checkpoint hands it the client_state (counters, RNG, model shape).
Either way the save is atomic (megatron.checkpoint.atomic_io.save_directory_atomically): Megatron's tracker file,
written last, names the new checkpoint only once every rank's files are complete, and a crash before leaves the
previous one tracked. With --async-save the files are written in a background thread from a host copy and
published at the next save, load or finalize_async_save().
"""
import os
import shutil

import torch.distributed as dist

import mpu
from megatron import print_rank_0, unwrap_model
from megatron.checkpoint import atomic_io, layout as ckpt
from megatron.checkpoint.rng import get_rng_state


def is_zero_engine(model):
    """The ZeRO engine (--deepspeed) saves and loads itself in the ZeRO layout; told apart by DeepSpeed's API
    (this package does not import megatron.zero, which builds on it)."""
    return callable(getattr(model, "zero_optimization_stage", None))


def rank_file(directory, mp_rank=None):
    """This rank's file in a Megatron-layout checkpoint directory (rank_dir_name's directory per rank/stage)."""
    rank = mpu.get_model_parallel_rank() if mp_rank is None else mp_rank
    stage = mpu.get_pipeline_model_parallel_rank() if mpu.get_pipeline_model_parallel_world_size() > 1 else None
    return os.path.join(directory, ckpt.rank_dir_name(rank, stage), ckpt.CHECKPOINT_FILENAME)


def model_shape(model):
    """The fields a loading model must match (from the GPT2Model's config); None for a model without one."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return None
    shape = ckpt.model_shape_record(config.num_layers, config.hidden_size, config.num_attention_heads,
                                    config.vocab_size, mpu.get_model_parallel_world_size(), config.real_vocab_size,
                                    config.layernorm_epsilon, getattr(config, "lora", None),
                                    ckpt.architecture_record(config), config.max_sequence_length)
    shape[ckpt.VIRTUAL_PIPELINE_SIZE] = model_chunks(model)
    return shape


def model_chunks(model):
    """Model chunks per pipeline stage (interleaved pipeline; 1 otherwise)."""
    return getattr(unwrap_model(model), "num_chunks", 1)


def optimizer_param_names(module, optimizer):
    """Per param group of the Megatron-path optimizer (torch's, or FP16_Optimizer over fp32 masters), the names
    of its parameters in order: what lets another topology read the optimizer state by name."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    if hasattr(optimizer, "model_params"):  # FP16_Optimizer: the groups hold masters, model_params the params
        params, groups = iter(optimizer.model_params), []
        for group in optimizer.param_groups:
            groups.append([name_of[id(next(params))] for _ in group["params"]])
        return groups
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def run_state(train_state, options):
    """The counters (TrainState.to_state) and, unless no_save_rng, every RNG state: what resuming needs besides
    the model and optimizer (the ZeRO path stores it as client_state; loading.restore_run_state reads it)."""
    state = train_state.to_state()
    if not options.no_save_rng:
        state[ckpt.RNG] = get_rng_state()
    return state


def checkpoint_state(train_state, model, optimizer, lr_scheduler, options):
    """What one model-parallel rank's model_optim_rng.pt holds (never the argparse Namespace)."""
    state = {ckpt.MODEL: unwrap_model(model).state_dict(), ckpt.MODEL_SHAPE: model_shape(model),
             **run_state(train_state, options)}
    if not options.no_save_optim:
        state[ckpt.OPTIMIZER] = optimizer.state_dict()
        state[ckpt.LR_SCHEDULER] = lr_scheduler.state_dict()
        state[ckpt.PARAM_NAMES] = optimizer_param_names(unwrap_model(model), optimizer)
    return state


def save_ds_checkpoint(train_state, model, options):
    """Save through the ZeRO engine (DESIGN.md section 6): the counters, model shape and every RNG state go into
    client_state; the engine writes its files and `latest` atomically under the iteration's tag; then rank 0
    writes Megatron's tracker and prunes (--save-keep-last)."""
    iteration = train_state.iteration      # train_state goes on changing while an --async-save is in flight
    client_state = {**run_state(train_state, options), ckpt.MODEL_SHAPE: model_shape(model)}
    model.save_checkpoint(options.save, ckpt.iteration_dir_name(iteration), client_state=client_state,
                          async_save=options.async_save, on_commit=lambda: _commit(options, iteration))
    _announce(options, iteration)


def save_checkpoint(train_state, model, optimizer, lr_scheduler, options):
    """Atomically save `train_state.iteration` to options.save; every rank must call it. Raises CheckpointError
    on every rank when any rank failed, leaving the previous checkpoint and the tracker untouched. A ZeRO engine
    (--deepspeed) saves through save_ds_checkpoint.

    options.async_save (--async-save): this returns once the state is copied to host memory (host_copy, the
    same structure: the same file bytes); a background thread writes and fsyncs this rank's files. The
    cross-rank agreement, the manifest and publication (the tracker) run on the training thread when the next
    save, a load or finalize_async_save() (the end of training) finishes it (megatron.checkpoint.atomic_io):
    until then the previous checkpoint stays the published one, and an error is raised there."""
    if is_zero_engine(model):
        save_ds_checkpoint(train_state, model, options)
        return

    iteration = train_state.iteration      # train_state goes on changing while an --async-save is in flight

    def write(tmp_dir):
        if mpu.get_data_parallel_rank(with_context_parallel=True) == 0:   # one writer per tp/pp rank
            state = ckpt.host_copy(checkpoint_state(train_state, model, optimizer, lr_scheduler, options),
                                   clone=options.async_save and atomic_io.background_writes_need_copies())
            path = rank_file(tmp_dir)
            return lambda: [_write_state(state, path)]
        return []
    atomic_io.save_directory_atomically(
        ckpt.checkpoint_dir(options.save, iteration), write, lambda: _commit(options, iteration), mpu.get_device(),
        is_rank_0=dist.get_rank() == 0, error_class=ckpt.CheckpointError, background=options.async_save)
    _announce(options, iteration)


def finalize_async_save():
    """Finish the --async-save in flight, if any (wait for its files, agree, manifest, publish): every rank
    calls it at the end of training (collective)."""
    atomic_io.finish_pending_save()


def _commit(options, iteration):
    """Rank 0, once the checkpoint directory is in place: the tracker (the commit point), pruning."""
    ckpt.write_tracker(options.save, iteration)
    if options.save_keep_last:
        _prune(options.save, iteration, options.save_keep_last)
    if options.async_save:
        print(f"  published checkpoint at iteration {iteration} in {options.save} (--async-save)", flush=True)


def _announce(options, iteration):
    if options.async_save:
        print_rank_0(f"  saving checkpoint at iteration {iteration} to {options.save} in the background")
    else:
        print_rank_0(f"  saved checkpoint at iteration {iteration} to {options.save}")


def _write_state(state, path):
    """Write `state` to `path`; returns its manifest entry."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    entry = ckpt.atomic_torch_save(state, path)
    atomic_io.fsync_dir(directory)
    return entry


def iterations_saved(save_dir):
    """The iterations of the iter_* directories in `save_dir`, newest first."""
    return sorted((int(m.group(1)) for m in map(ckpt.ITERATION_DIR_PATTERN.match, os.listdir(save_dir)) if m),
                  reverse=True)


def _prune(save_dir, current, keep_last):
    """Keep `current` and the newest keep_last - 1 other iter_* directories."""
    others = [it for it in iterations_saved(save_dir) if it != current]
    for stale in others[keep_last - 1:]:
        shutil.rmtree(ckpt.checkpoint_dir(save_dir, stale))
