"""Loading a checkpoint, both paths, any saving topology (DESIGN.md section 6).

A load first checks the files against the manifest (all ranks share the reading); a damaged checkpoint is skipped,
with a line saying why, for the newest older one that verifies. Loading uses torch.load(weights_only=True), so a
checkpoint file can never run code. At the saving path and model-parallel size each path's own loader runs (bitwise
resume; the ZeRO engine also re-partitions for another data-parallel size); anything else goes through
megatron.checkpoint.reshard_load.

Load flags (CheckpointOptions): finetune loads the weights only (iteration, consumed samples, optimizer, lr
scheduler and RNG start fresh); no_load_optim keeps the counters but starts a fresh optimizer and lr scheduler (as
Megatron does); no_load_rng keeps this run's seeded RNG states. A `release` tracker behaves like finetune.
"""
import os

import torch.distributed as dist

import mpu
from megatron import print_rank_0, unwrap_model
from megatron.checkpoint import atomic_io, reshard, reshard_load
from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.optimizer_kind import check_same_optimizer
from megatron.checkpoint.rng import set_rng_state
from megatron.checkpoint.saving import is_zero_engine, iterations_saved, model_chunks, model_shape, rank_file
from megatron.train_state import TrainState


def get_checkpoint_iteration(load_dir):
    """(iteration, release) from load_dir's tracker file, or (None, False) when there is none."""
    return ckpt.read_tracker(load_dir) or (None, False)


def load_checkpoint(model, optimizer, lr_scheduler, options):
    """Load options.load's tracked checkpoint into model (and optimizer, lr scheduler, RNG, as the options allow).
    Returns the TrainState to continue from: a fresh one when there is no tracker (a one-line notice), with
    finetune, or for a release checkpoint. Every rank must call it; an error on any rank raises on all.
    The checkpoint's files are verified against its manifest first; when one is damaged, the newest older
    checkpoint that verifies is loaded instead (newest_verified_checkpoint)."""
    iteration, release = get_checkpoint_iteration(options.load)
    deepspeed_tag = deepspeed_written_tag(options.load, iteration, release)
    if iteration is None and deepspeed_tag is None:
        print_rank_0(f"WARNING: could not find the metadata file "
                     f"{os.path.join(options.load, ckpt.TRACKER_FILENAME)}; will not load any checkpoints and "
                     "will start from random")
        return TrainState()
    if deepspeed_tag is None:
        iteration, release = newest_verified_checkpoint(options.load, iteration, release)
    tag = deepspeed_tag or os.path.basename(ckpt.checkpoint_dir("", iteration, release))
    result = {}
    error = atomic_io.capture_error(_load_any_topology, result, model, optimizer, lr_scheduler, options, tag,
                                    release)
    atomic_io.agree_on_success(error, f"loading {os.path.join(options.load, tag)}", mpu.get_device(),
                               error_class=ckpt.CheckpointError)
    where = f"iteration {iteration}" if deepspeed_tag is None else tag
    print_rank_0(f"  loaded checkpoint from {options.load} at {where}")
    return result["train_state"]


def deepspeed_written_tag(load_dir, iteration, release):
    """The tag in `load_dir/latest` when the checkpoint to load is one DeepSpeed wrote (global_step<N>): there is
    no tracker, or Megatron-DeepSpeed's tracker names an iteration whose iter_* directory does not exist; else
    None."""
    tag = ckpt.read_latest_tag(load_dir)
    if tag is None or not os.path.isdir(atomic_io.readable_directory(os.path.join(load_dir, tag))):
        return None
    if iteration is not None and os.path.isdir(atomic_io.readable_directory(
            ckpt.checkpoint_dir(load_dir, iteration, release))):
        return None
    return tag


def newest_verified_checkpoint(load_dir, iteration, release):
    """(iteration, release) of the tracked checkpoint when all its files match its manifest, else of the newest
    older iter_* checkpoint that does, each one skipped printed with the reason (a release checkpoint has no
    fallback). CheckpointError when none verifies. A directory without a manifest counts as verified (announced).
    Collective: the ranks share the checksumming. A missing tracked directory is left to the load to report."""
    if not os.path.isdir(atomic_io.readable_directory(ckpt.checkpoint_dir(load_dir, iteration, release))):
        return iteration, release
    older = [] if release else iterations_saved(load_dir)
    skipped = []
    for candidate in [iteration] + [it for it in older if it < iteration]:
        directory = atomic_io.readable_directory(ckpt.checkpoint_dir(load_dir, candidate, release))
        problem = _problem_found_by_any_rank(directory)
        if problem is None:
            ckpt.mark_directory_verified(directory)
            if skipped:
                print_rank_0(f"loading {directory} instead: the newest checkpoint in {load_dir} that verifies")
            return candidate, release
        print_rank_0(f"WARNING: skipping checkpoint {directory}: {problem}")
        skipped.append(f"{os.path.basename(directory)}: {problem}")
    raise ckpt.CheckpointError(f"no checkpoint in {load_dir} verifies ({'; '.join(skipped)}): restore the damaged "
                               "files from a copy, or start without --load")


def _problem_found_by_any_rank(directory):
    """The first problem any rank finds in `directory`, or None. Each rank checksums its share of the files
    (about 1/world of the bytes); every rank gets the same answer."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        problem = ckpt.verify_checkpoint_directory(directory, rank, world)
    except Exception as error:  # any failure is this rank's answer: the others must not wait for it
        problem = f"{type(error).__name__}: {error}"
    if world == 1:
        return problem
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def _load_any_topology(result, model, optimizer, lr_scheduler, options, tag, release):
    """At the saving path and model-parallel size, that path's own loader (bitwise resume; the ZeRO engine also
    re-partitions for another data-parallel size); anything else through megatron.checkpoint.reshard_load."""
    directory = atomic_io.readable_directory(os.path.join(options.load, tag))
    if not os.path.isdir(directory):
        match = ckpt.ITERATION_DIR_PATTERN.match(tag)
        named = f"iteration {int(match.group(1))}" if match else tag
        raise ckpt.CheckpointError(f"tracker file {os.path.join(options.load, ckpt.TRACKER_FILENAME)} names "
                                   f"{named}, but {directory} does not exist")
    zero = is_zero_engine(model)  # --deepspeed
    saved = reshard.SavedCheckpoint(options.load, os.path.basename(directory))   # memory-mapped: cheap
    config = getattr(unwrap_model(model), "config", None)
    if config is not None:
        reshard_load.check_lora_adapters(saved, config)
    same_padding = config is None or saved.padded_vocab_size() == config.vocab_size
    # the same stages holding the same layers (an interleaved stage holds other layers than a plain one)
    same_pipeline = saved.pipeline_model_parallel_size == mpu.get_pipeline_model_parallel_world_size() and \
        saved.model_shape.get(ckpt.VIRTUAL_PIPELINE_SIZE, 1) == model_chunks(model)
    if saved.path == ("zero" if zero else "megatron") and \
            saved.model_parallel_size == mpu.get_model_parallel_world_size() and same_padding and same_pipeline:
        if zero:
            # the model shape first: a model of another shape (MoE without --num-experts) would fail inside
            # load_state_dict with torch's lists of missing and unexpected keys
            _check_model_shape(saved.run_state.get(ckpt.MODEL_SHAPE), model, saved.directory)
            _load_ds_checkpoint(result, model, options, tag, release)
        else:
            _load_into(result, model, optimizer, lr_scheduler, options, tag, release)
        return
    result["train_state"] = reshard_load.load_resharded(model, optimizer, lr_scheduler, saved, options,
                                                        fresh=release or options.finetune)


def _load_into(result, model, optimizer, lr_scheduler, options, tag, release):
    path = _checkpoint_path_for_load(options.load, tag)
    state = ckpt.safe_torch_load(path)
    missing = [key for key in (ckpt.ITERATION, ckpt.MODEL, ckpt.MODEL_SHAPE) if key not in state]
    if missing:
        raise ckpt.CheckpointError(f"{path} lacks {', '.join(missing)}: not a checkpoint written by save_checkpoint")
    _check_model_shape(state[ckpt.MODEL_SHAPE], model, path)
    try:
        unwrap_model(model).load_state_dict(state[ckpt.MODEL])
    except RuntimeError as e:
        raise ckpt.CheckpointError(f"{path}: the saved weights do not fit this model: {e}") from None
    fresh = release or options.finetune
    if not fresh and not options.no_load_optim:
        _require(state, (ckpt.OPTIMIZER, ckpt.LR_SCHEDULER), path, "--no-save-optim", "--no-load-optim")
        saved_optimizer = state[ckpt.OPTIMIZER].get("optimizer", state[ckpt.OPTIMIZER])   # inside FP16_Optimizer's
        check_same_optimizer(saved_optimizer["param_groups"], optimizer.param_groups, path)
        optimizer.load_state_dict(state[ckpt.OPTIMIZER])
        try:
            lr_scheduler.load_state_dict(state[ckpt.LR_SCHEDULER])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{path}: {e}") from None
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 master copies of the weights just loaded
    result["train_state"] = restore_run_state(state, options, path, fresh)


def _load_ds_checkpoint(result, model, options, tag, release):
    """The ZeRO engine loads module, optimizer partitions (re-partitioned for this data-parallel size) and lr
    scheduler; client_state gives back the counters and RNG states."""
    fresh = release or options.finetune
    load_optimizer = not (fresh or options.no_load_optim)
    try:
        path, client_state = model.load_checkpoint(options.load, tag, load_optimizer_states=load_optimizer,
                                                   load_lr_scheduler_states=load_optimizer)
    except RuntimeError as e:  # a state dict that does not fit this model
        if isinstance(e, ckpt.CheckpointError):
            raise
        raise ckpt.CheckpointError(f"{options.load}/{tag}: the saved weights do not fit this model: {e}") from None
    if path is None:
        raise ckpt.CheckpointError("Unable to load checkpoint.")
    result["train_state"] = restore_run_state(client_state, options, path, fresh)


def restore_run_state(state, options, path, fresh):
    """RNG states (unless no_load_rng) and the counters from a checkpoint's `state` (for the ZeRO path: its
    client_state) as a TrainState; `fresh` (finetune, release) gives a fresh one and keeps this run's RNG."""
    if fresh:
        return TrainState()
    if not options.no_load_rng:
        _require(state, (ckpt.RNG,), path, "--no-save-rng", "--no-load-rng")
        set_rng_state(state[ckpt.RNG])
    return TrainState.from_state(state)


def _checkpoint_path_for_load(load_dir, tag):
    """This rank's file, with errors that say what is there instead."""
    directory = atomic_io.readable_directory(os.path.join(load_dir, tag))
    path = rank_file(directory)
    if not os.path.isfile(path):
        ranks = sorted(name for name in os.listdir(directory) if ckpt.RANK_DIR_PATTERN.match(name))
        raise ckpt.CheckpointError(f"{path} does not exist: {directory} holds {ranks or 'no mp_rank_* directories'} "
                                   f"(model-parallel size {len(ranks)}), this run has model-parallel size "
                                   f"{mpu.get_model_parallel_world_size()}")
    return path


def _check_model_shape(saved, model, path):
    ours = model_shape(model)
    if saved is None or ours is None:
        return
    ckpt.check_model_shape(saved, ours, ckpt.MODEL_SHAPE_FIELDS, path)


def _require(state, keys, path, saved_flag, load_flag):
    missing = [key for key in keys if key not in state]
    if missing:
        raise ckpt.CheckpointError(f"{path} has no {', '.join(missing)} (saved with {saved_flag}?): pass "
                                   f"{load_flag} or --finetune to start it fresh")
