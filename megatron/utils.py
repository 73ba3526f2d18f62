"""Training-script utilities (what the seed tutorial puts here): logging on rank 0, loss reduction, RNG-state
capture/restore, and checkpoint save/load for both paths (DESIGN.md section 6).

Megatron-path layout (one file per model-parallel rank, written by data-parallel rank 0 of each):

    SAVE/iter_0000200/mp_rank_00/model_optim_rng.pt
    SAVE/iter_0000200/mp_rank_01/model_optim_rng.pt
    SAVE/iter_0000200/manifest.json                 every file's size and crc32 (megatron.manifest), written last
    SAVE/latest_checkpointed_iteration.txt          "200" (or "release" for SAVE/release/...)

Under pipeline parallelism each stage has its own directory, Megatron's name: mp_rank_{tp:02d}_{pp:03d}/ (P = 1
keeps the names above), holding that stage's parameters under the single-stage model's names.

ZeRO path (--deepspeed): the engine writes SAVE/iter_0000200/ and SAVE/latest itself; save_ds_checkpoint adds
the client_state (counters, RNG, model shape) and Megatron's tracker file.

A save is atomic (megatron.atomic_io.save_directory_atomically): a crash at any point leaves the tracker naming the
previous, complete checkpoint. With --async-save the files are written in a background thread from a host copy
and published at the next save, load or finalize_async_save() (save_checkpoint). A load first checks the files against the manifest (all ranks share the reading); a
damaged checkpoint is skipped, with a line saying why, for the newest older one that verifies. Loading uses
torch.load(weights_only=True), so a checkpoint file can never run code; every value saved is a tensor, number, str,
None, or a list/dict of those (RNG states included). File names and keys: megatron.zero.checkpoint.

The path follows the model: a ZeRO engine (--deepspeed) is saved and loaded in the ZeRO layout. Load flags
(CheckpointOptions): finetune loads the weights only (iteration, consumed samples, optimizer, lr
scheduler and RNG start fresh); no_load_optim keeps the counters but starts a fresh optimizer and lr scheduler (as
Megatron does); no_load_rng keeps this run's seeded RNG states. A `release` tracker behaves like finetune.
"""
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

import mpu
from megatron import atomic_io, breadcrumbs, reshard, reshard_load
from megatron.train_state import TrainState
from megatron.zero import ZeroEngine
from megatron.zero.checkpoint import (CHECKPOINT_FILENAME, CONSUMED_TRAIN_SAMPLES, CONSUMED_VALID_SAMPLES,
                                      ITERATION, ITERATION_DIR_PATTERN, LR_SCHEDULER, MODEL, MODEL_SHAPE,
                                      MODEL_SHAPE_FIELDS, OPTIMIZER, PARAM_NAMES, RELEASE, RNG, SKIPPED_ITERATIONS,
                                      TRACKER_FILENAME, CheckpointError, atomic_torch_save, atomic_write_text,
                                      host_copy, iteration_dir_name, mark_directory_verified,
                                      megatron_rank_dir_name,
                                      safe_torch_load, verify_checkpoint_directory)


def print_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def reduce_losses(losses):
    """Average each loss over the data-parallel group; returns a tensor of the averages (detached)."""
    reduced = torch.stack([loss.detach().float() for loss in losses])
    breadcrumbs.all_reduce(reduced, "reduce_losses", group=mpu.get_data_parallel_group())
    return reduced / mpu.get_data_parallel_world_size()


def unwrap_model(model):
    """The bare module inside DDP wrappers or the ZeRO engine."""
    while hasattr(model, "module"):
        model = model.module
    return model


# ---------------------------------------------------------------------------------------------------- RNG states

def get_rng_state():
    """Every RNG state (python, numpy, torch, cuda when present, every mpu tracker state), as tensors and plain
    values so that torch.load(weights_only=True) reads them back. Also used by the ZeRO path's client_state."""
    version, python_state, gauss = random.getstate()
    state = {"python_version": version, "python": torch.tensor(python_state, dtype=torch.int64),
             "python_gauss": gauss, "numpy": _numpy_state(), "torch": torch.get_rng_state(),
             "tracker": mpu.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_rng_state(state):
    """Restore what get_rng_state() returned (without a "tracker" entry, e.g. from a checkpoint resized to another
    model-parallel size, the model-parallel tracker keeps its seeded states)."""
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()),
                     state["python_gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        mpu.get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------------------------- file names

def get_checkpoint_dir(checkpoints_path, iteration, release=False):
    return os.path.join(checkpoints_path, RELEASE if release else iteration_dir_name(iteration))


def _rank_file(directory, mp_rank=None):
    """This rank's file: mp_rank_{tp:02d}/, or mp_rank_{tp:02d}_{pp:03d}/ under pipelining (Megatron's names)."""
    rank = mpu.get_model_parallel_rank() if mp_rank is None else mp_rank
    name = megatron_rank_dir_name(rank)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{mpu.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(directory, name, CHECKPOINT_FILENAME)


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


# ---------------------------------------------------------------------------------------------------- saving

def model_shape(model):
    """The fields a loading model must match (from the GPT2Model's config); None for a model without one."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return None
    shape = {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
             "num_attention_heads": config.num_attention_heads, "padded_vocab_size": config.vocab_size,
             "model_parallel_size": mpu.get_model_parallel_world_size(), "vocab_size": config.real_vocab_size,
             "layernorm_epsilon": config.layernorm_epsilon}
    lora = getattr(config, "lora", None)
    if lora is not None:   # recorded (not compared on load): convert_to_hf merges with the run's alpha / rank
        shape.update(lora_rank=lora.rank, lora_alpha=lora.alpha)
    return shape


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
    """Iteration, consumed samples, skipped iterations and (unless no_save_rng) every RNG state: what resuming
    needs besides the model and optimizer (the ZeRO path stores it as client_state; restore_run_state reads it)."""
    state = {ITERATION: train_state.iteration, CONSUMED_TRAIN_SAMPLES: train_state.consumed_train_samples,
             CONSUMED_VALID_SAMPLES: train_state.consumed_valid_samples,
             SKIPPED_ITERATIONS: train_state.skipped_iterations}
    if not options.no_save_rng:
        state[RNG] = get_rng_state()
    return state


def checkpoint_state(train_state, model, optimizer, lr_scheduler, options):
    """What one model-parallel rank's model_optim_rng.pt holds (never the argparse Namespace)."""
    state = {MODEL: unwrap_model(model).state_dict(), MODEL_SHAPE: model_shape(model),
             **run_state(train_state, options)}
    if not options.no_save_optim:
        state[OPTIMIZER] = optimizer.state_dict()
        state[LR_SCHEDULER] = lr_scheduler.state_dict()
        state[PARAM_NAMES] = optimizer_param_names(unwrap_model(model), optimizer)
    return state


def save_ds_checkpoint(train_state, model, options):
    """Save through the ZeRO engine (DESIGN.md section 6): the counters, model shape and every RNG state go into
    client_state; the engine writes its files and `latest` atomically under the iteration's tag; then rank 0
    writes Megatron's tracker and prunes (--save-keep-last)."""
    iteration = train_state.iteration      # train_state goes on changing while an --async-save is in flight
    client_state = {**run_state(train_state, options), MODEL_SHAPE: model_shape(model)}
    model.save_checkpoint(options.save, iteration_dir_name(iteration), client_state=client_state,
                          async_save=options.async_save, on_commit=lambda: _commit(options, iteration))
    _announce(options, iteration)


def save_checkpoint(train_state, model, optimizer, lr_scheduler, options):
    """Atomically save `train_state.iteration` to options.save; every rank must call it. Raises CheckpointError
    on every rank when any rank failed, leaving the previous checkpoint and the tracker untouched. A ZeRO engine
    (--deepspeed) saves through save_ds_checkpoint.

    options.async_save (--async-save): this returns once the state is copied to host memory (host_copy, the
    same structure: the same file bytes); a background thread writes and fsyncs this rank's files. The
    cross-rank agreement, the manifest and publication (the tracker) run on the training thread when the next
    save, a load or finalize_async_save() (the end of training) finishes it (megatron.atomic_io): until then
    the previous checkpoint stays the published one, and an error is raised there."""
    if isinstance(model, ZeroEngine):
        save_ds_checkpoint(train_state, model, options)
        return

    iteration = train_state.iteration      # train_state goes on changing while an --async-save is in flight

    def write(tmp_dir):
        if mpu.get_data_parallel_rank() == 0:
            state = host_copy(checkpoint_state(train_state, model, optimizer, lr_scheduler, options),
                              clone=options.async_save)
            path = _rank_file(tmp_dir)
            return lambda: [_write_state(state, path)]
        return []
    atomic_io.save_directory_atomically(
        get_checkpoint_dir(options.save, iteration), write, lambda: _commit(options, iteration), mpu.get_device(),
        is_rank_0=dist.get_rank() == 0, error_class=CheckpointError, background=options.async_save)
    _announce(options, iteration)


def finalize_async_save():
    """Finish the --async-save in flight, if any (wait for its files, agree, manifest, publish): every rank
    calls it at the end of training (collective)."""
    atomic_io.finish_pending_save()


def _commit(options, iteration):
    """Rank 0, once the checkpoint directory is in place: the tracker (the commit point), pruning."""
    _write_tracker_and_prune(options.save, iteration, options.save_keep_last)
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
    entry = atomic_torch_save(state, path)
    atomic_io.fsync_dir(directory)
    return entry


def _write_tracker_and_prune(save_dir, iteration, keep_last):
    atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
    if keep_last:
        _prune(save_dir, iteration, keep_last)


def _prune(save_dir, current, keep_last):
    """Keep `current` and the newest keep_last - 1 other iter_* directories."""
    others = sorted((int(m.group(1)) for m in map(ITERATION_DIR_PATTERN.match, os.listdir(save_dir)) if m),
                    reverse=True)
    others = [it for it in others if it != current]
    for stale in others[keep_last - 1:]:
        shutil.rmtree(get_checkpoint_dir(save_dir, stale))


def _agree(error, what):
    atomic_io.agree_on_success(error, what, mpu.get_device(), error_class=CheckpointError)


# ---------------------------------------------------------------------------------------------------- loading

def get_checkpoint_iteration(load_dir):
    """(iteration, release) from load_dir's tracker file, or (None, False) when there is none."""
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None, False
    with open(tracker) as handle:
        text = handle.read().strip()
    if text == RELEASE:
        return 0, True
    if not text.isdigit():
        raise CheckpointError(f"tracker file {tracker} holds {text!r}: expected an iteration number or 'release'")
    return int(text), False


def load_checkpoint(model, optimizer, lr_scheduler, options):
    """Load options.load's tracked checkpoint into model (and optimizer, lr scheduler, RNG, as the options allow).
    Returns the TrainState to continue from: a fresh one when there is no tracker (a one-line notice), with
    finetune, or for a release checkpoint. Every rank must call it; an error on any rank raises on all.
    The checkpoint's files are verified against its manifest first; when one is damaged, the newest older
    checkpoint that verifies is loaded instead (newest_verified_checkpoint)."""
    iteration, release = get_checkpoint_iteration(options.load)
    if iteration is None:
        print_rank_0(f"WARNING: could not find the metadata file {get_checkpoint_tracker_filename(options.load)}; "
                     "will not load any checkpoints and will start from random")
        return TrainState()
    iteration, release = newest_verified_checkpoint(options.load, iteration, release)
    result = {}
    error = atomic_io.capture_error(_load_any_topology, result, model, optimizer, lr_scheduler, options, iteration,
                                    release)
    _agree(error, f"loading {get_checkpoint_dir(options.load, iteration, release)}")
    print_rank_0(f"  loaded checkpoint from {options.load} at iteration {iteration}")
    return result["train_state"]


def newest_verified_checkpoint(load_dir, iteration, release):
    """(iteration, release) of the tracked checkpoint when all its files match its manifest, else of the newest
    older iter_* checkpoint that does, each one skipped printed with the reason (a release checkpoint has no
    fallback). CheckpointError when none verifies. A directory without a manifest counts as verified (announced).
    Collective: the ranks share the checksumming. A missing tracked directory is left to the load to report."""
    if not os.path.isdir(atomic_io.readable_directory(get_checkpoint_dir(load_dir, iteration, release))):
        return iteration, release
    older = [] if release else sorted((int(m.group(1)) for m in map(ITERATION_DIR_PATTERN.match,
                                                                        os.listdir(load_dir)) if m), reverse=True)
    skipped = []
    for candidate in [iteration] + [it for it in older if it < iteration]:
        directory = atomic_io.readable_directory(get_checkpoint_dir(load_dir, candidate, release))
        problem = _problem_found_by_any_rank(directory)
        if problem is None:
            mark_directory_verified(directory)
            if skipped:
                print_rank_0(f"loading {directory} instead: the newest checkpoint in {load_dir} that verifies")
            return candidate, release
        print_rank_0(f"WARNING: skipping checkpoint {directory}: {problem}")
        skipped.append(f"{os.path.basename(directory)}: {problem}")
    raise CheckpointError(f"no checkpoint in {load_dir} verifies ({'; '.join(skipped)}): restore the damaged files "
                          "from a copy, or start without --load")


def _problem_found_by_any_rank(directory):
    """The first problem any rank finds in `directory`, or None. Each rank checksums its share of the files
    (about 1/world of the bytes); every rank gets the same answer."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        problem = verify_checkpoint_directory(directory, rank, world)
    except Exception as error:  # any failure is this rank's answer: the others must not wait for it
        problem = f"{type(error).__name__}: {error}"
    if world == 1:
        return problem
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def _load_any_topology(result, model, optimizer, lr_scheduler, options, iteration, release):
    """At the saving path and model-parallel size, that path's own loader (bitwise resume; the ZeRO engine also
    re-partitions for another data-parallel size); anything else through megatron.reshard."""
    directory = atomic_io.readable_directory(get_checkpoint_dir(options.load, iteration, release))
    if not os.path.isdir(directory):
        raise CheckpointError(f"tracker file {get_checkpoint_tracker_filename(options.load)} names iteration "
                              f"{iteration}, but {directory} does not exist")
    zero = isinstance(model, ZeroEngine)  # --deepspeed
    saved = reshard.SavedCheckpoint(options.load, os.path.basename(directory))   # memory-mapped: cheap
    config = getattr(unwrap_model(model), "config", None)
    same_padding = config is None or saved.padded_vocab_size() == config.vocab_size
    same_pipeline = saved.pipeline_model_parallel_size == mpu.get_pipeline_model_parallel_world_size()
    if saved.path == ("zero" if zero else "megatron") and \
            saved.model_parallel_size == mpu.get_model_parallel_world_size() and same_padding and same_pipeline:
        if zero:
            _load_ds_checkpoint(result, model, options, iteration, release)
        else:
            _load_into(result, model, optimizer, lr_scheduler, options, iteration, release)
        return
    result["train_state"] = reshard_load.load_resharded(model, optimizer, lr_scheduler, saved, options,
                                                        fresh=release or options.finetune)


def _load_into(result, model, optimizer, lr_scheduler, options, iteration, release):
    path = _checkpoint_path_for_load(options.load, iteration, release)
    state = safe_torch_load(path)
    missing = [key for key in (ITERATION, MODEL, MODEL_SHAPE) if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a checkpoint written by save_checkpoint")
    _check_model_shape(state[MODEL_SHAPE], model, path)
    try:
        unwrap_model(model).load_state_dict(state[MODEL])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the saved weights do not fit this model: {e}") from None
    fresh = release or options.finetune
    if not fresh and not options.no_load_optim:
        _require(state, (OPTIMIZER, LR_SCHEDULER), path, "--no-save-optim", "--no-load-optim")
        optimizer.load_state_dict(state[OPTIMIZER])
        try:
            lr_scheduler.load_state_dict(state[LR_SCHEDULER])
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 master copies of the weights just loaded
    result["train_state"] = restore_run_state(state, options, path, fresh)


def _load_ds_checkpoint(result, model, options, iteration, release):
    """The ZeRO engine loads module, optimizer partitions (re-partitioned for this data-parallel size) and lr
    scheduler; client_state gives back the counters and RNG states."""
    fresh = release or options.finetune
    load_optimizer = not (fresh or options.no_load_optim)
    tag = os.path.basename(get_checkpoint_dir("", iteration, release))
    try:
        path, client_state = model.load_checkpoint(options.load, tag, load_optimizer_states=load_optimizer,
                                                   load_lr_scheduler_states=load_optimizer)
    except RuntimeError as e:  # a state dict that does not fit this model
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{options.load}/{tag}: the saved weights do not fit this model: {e}") from None
    if path is None:
        raise CheckpointError("Unable to load checkpoint.")
    if MODEL_SHAPE in client_state:
        _check_model_shape(client_state[MODEL_SHAPE], model, path)
    result["train_state"] = restore_run_state(client_state, options, path, fresh)


def restore_run_state(state, options, path, fresh):
    """RNG states (unless no_load_rng) and the counters from a checkpoint's `state` (for the ZeRO path: its
    client_state) as a TrainState; `fresh` (finetune, release) gives a fresh one and keeps this run's RNG."""
    if fresh:
        return TrainState()
    if not options.no_load_rng:
        _require(state, (RNG,), path, "--no-save-rng", "--no-load-rng")
        set_rng_state(state[RNG])
    return TrainState(iteration=int(state[ITERATION]), consumed_train_samples=int(state[CONSUMED_TRAIN_SAMPLES]),
                      consumed_valid_samples=int(state[CONSUMED_VALID_SAMPLES]),
                      skipped_iterations=int(state[SKIPPED_ITERATIONS]))


def _checkpoint_path_for_load(load_dir, iteration, release):
    """This rank's file, with errors that say what is there instead."""
    directory = atomic_io.readable_directory(get_checkpoint_dir(load_dir, iteration, release))
    path = _rank_file(directory)
    if not os.path.isfile(path):
        ranks = sorted(name for name in os.listdir(directory) if re.fullmatch(r"mp_rank_\d+(_\d{3})?", name))
        raise CheckpointError(f"{path} does not exist: {directory} holds {ranks or 'no mp_rank_* directories'} "
                              f"(model-parallel size {len(ranks)}), this run has model-parallel size "
                              f"{mpu.get_model_parallel_world_size()}")
    return path


def _check_model_shape(saved, model, path):
    ours = model_shape(model)
    if saved is None or ours is None:
        return
    diffs = [f"{field} {saved.get(field)} (checkpoint) != {ours[field]} (this run)"
             for field in MODEL_SHAPE_FIELDS if saved.get(field) != ours[field]]
    if diffs:
        raise CheckpointError(f"{path} was saved by another model shape: {'; '.join(diffs)}")


def _require(state, keys, path, saved_flag, load_flag):
    missing = [key for key in keys if key not in state]
    if missing:
        raise CheckpointError(f"{path} has no {', '.join(missing)} (saved with {saved_flag}?): pass {load_flag} "
                              "or --finetune to start it fresh")
