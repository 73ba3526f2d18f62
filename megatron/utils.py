"""Training-script utilities: logging on rank 0, loss reduction, unwrapping, exit conditions, and checkpoint
save/load for the Megatron path (DESIGN.md section 6).

Checkpoint layout (one file per model-parallel rank, written by data-parallel rank 0 of each):

    SAVE/iter_0000200/mp_rank_00/model_optim_rng.pt
    SAVE/iter_0000200/mp_rank_01/model_optim_rng.pt
    SAVE/latest_checkpointed_iteration.txt          "200" (or "release" for SAVE/release/...)

A save is atomic: every writer fills SAVE/iter_0000200.tmp/, all ranks meet (and agree that every write
succeeded), rank 0 renames the directory into place, then replaces the tracker file through a temporary name.
A crash at any point leaves the tracker naming the previous, complete checkpoint. Loading uses
torch.load(weights_only=True), so a checkpoint file can never run code; every value saved is a tensor, number,
str, None, or a list/dict of those (RNG states included).

Load flags: --finetune loads the weights only (iteration, consumed samples, optimizer, lr scheduler and RNG start
fresh); --no-load-optim keeps the counters but starts a fresh optimizer and lr scheduler (as Megatron does);
--no-load-rng keeps this run's seeded RNG states. A `release` tracker behaves like --finetune.
"""
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

import mpu
from megatron.zero.checkpoint import (LATEST_FILE, CheckpointError, agree_on_success, atomic_torch_save, atomic_write_text,
                                      capture_error, safe_torch_load)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
RELEASE = "release"

# Keys of model_optim_rng.pt.
ITERATION = "iteration"
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
RNG = "rng"
CONSUMED_TRAIN_SAMPLES = "consumed_train_samples"
CONSUMED_VALID_SAMPLES = "consumed_valid_samples"
SKIPPED_ITERATIONS = "skipped_iterations"
MODEL_SHAPE = "model_shape"
# Fields of MODEL_SHAPE, compared with this run's args on load.
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "model_parallel_size")

# Test-only fault injection: when this variable names the iteration being saved, every rank kills itself with
# SIGKILL after writing its file into the temporary directory and before the rename (tests/test_checkpoint.py).
KILL_IN_SAVE_ENV = "MEGATRON_TEST_SIGKILL_IN_SAVE"


def print_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def reduce_losses(losses):
    """Average each loss over the data-parallel group; returns a tensor of the averages (detached)."""
    reduced = torch.stack([loss.detach().float() for loss in losses])
    dist.all_reduce(reduced, group=mpu.get_data_parallel_group())
    return reduced / mpu.get_data_parallel_world_size()


def unwrap_model(model):
    """The bare module inside DDP wrappers or the ZeRO engine."""
    while hasattr(model, "module"):
        model = model.module
    return model


class ExitController:
    """Decides, identically on every rank, when training stops early: --exit-interval, --exit-duration-in-mins, or
    (--exit-signal-handler) a SIGTERM received by any rank. The time and signal flags are combined with one
    all-reduce (MAX) per step, so all ranks stop after the same iteration even when only one was signalled.
    Call close() after training to restore the previous SIGTERM handler."""

    def __init__(self, args):
        self.exit_interval = args.exit_interval
        self.exit_duration_secs = None if args.exit_duration_in_mins is None else args.exit_duration_in_mins * 60
        self.start_time = time.time()
        self.reason = None
        self.signal_received = False
        # A flag of its own: signal.signal() returns None for a handler installed outside Python, so "previous
        # handler is None" cannot mean "no handler installed" (a rank that thought so would skip the all-reduce).
        self.handles_signal = bool(args.exit_signal_handler)
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if self.handles_signal else None

    def _on_sigterm(self, signum, frame):
        self.signal_received = True

    def close(self):
        if self.handles_signal:
            previous = self._previous_handler
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self.handles_signal, self._previous_handler = False, None

    def should_exit(self, iteration):
        if self.exit_interval and iteration % self.exit_interval == 0:
            self.reason = f"--exit-interval {self.exit_interval}"
            return True
        if self.exit_duration_secs is None and not self.handles_signal:
            return False
        time_up = self.exit_duration_secs is not None and time.time() - self.start_time > self.exit_duration_secs
        flags = torch.tensor([float(time_up), float(self.signal_received)], device=mpu.get_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            self.reason = "SIGTERM (--exit-signal-handler)"
            return True
        if flags[0].item():
            self.reason = "--exit-duration-in-mins"
            return True
        return False


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
    """Restore what get_rng_state() returned."""
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()),
                     state["python_gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mpu.get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------------------------- file names

def get_checkpoint_dir(checkpoints_path, iteration, release=False):
    return os.path.join(checkpoints_path, RELEASE if release else f"iter_{iteration:07d}")


def get_checkpoint_name(checkpoints_path, iteration, release=False, mp_rank=None):
    return _rank_file(get_checkpoint_dir(checkpoints_path, iteration, release), mp_rank)


def _rank_file(directory, mp_rank=None):
    rank = mpu.get_model_parallel_rank() if mp_rank is None else mp_rank
    return os.path.join(directory, f"mp_rank_{rank:02d}", CHECKPOINT_FILENAME)


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


# ---------------------------------------------------------------------------------------------------- saving

def model_shape(args):
    return {field: int(getattr(args, field)) for field in MODEL_SHAPE_FIELDS}


def run_state(iteration, args):
    """Iteration, consumed samples, skipped iterations and (unless --no-save-rng) every RNG state: what resuming
    needs besides the model and optimizer (the ZeRO path stores it as client_state; restore_run_state reads it)."""
    state = {ITERATION: iteration, CONSUMED_TRAIN_SAMPLES: args.consumed_train_samples,
             CONSUMED_VALID_SAMPLES: args.consumed_valid_samples, SKIPPED_ITERATIONS: args.skipped_iterations}
    if not args.no_save_rng:
        state[RNG] = get_rng_state()
    return state


def checkpoint_state(iteration, model, optimizer, lr_scheduler, args):
    """What one model-parallel rank's model_optim_rng.pt holds (never the argparse Namespace)."""
    state = {MODEL: unwrap_model(model).state_dict(), MODEL_SHAPE: model_shape(args), **run_state(iteration, args)}
    if not args.no_save_optim:
        state[OPTIMIZER] = optimizer.state_dict()
        state[LR_SCHEDULER] = lr_scheduler.state_dict()
    return state


def save_ds_checkpoint(iteration, model, args):
    """Save through the ZeRO engine (DESIGN.md section 6): the iteration, counters, model shape and every RNG state
    go into client_state; the engine writes its files into SAVE/iter_{:07d}.tmp/, which is renamed into place
    before `latest` and then Megatron's tracker are written (as atomic as the Megatron path)."""
    client_state = {**run_state(iteration, args), MODEL_SHAPE: model_shape(args)}

    def write(tmp_dir):  # the engine agrees across ranks itself; every rank returns the same outcome
        return capture_error(model.save_checkpoint, args.save, os.path.basename(tmp_dir), client_state, False)
    _save_atomically(iteration, args, write, latest_tag=ds_checkpoint_tag(iteration))


def ds_checkpoint_tag(iteration):
    """The engine's tag for a Megatron iteration: the same directory name as the Megatron path's."""
    return os.path.basename(get_checkpoint_dir("", iteration))


def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
    """Atomically save `iteration` to args.save; every rank must call it. Raises CheckpointError on every rank
    when any rank failed, leaving the previous checkpoint and the tracker untouched."""
    if args.deepspeed:
        save_ds_checkpoint(iteration, model, args)
        return

    def write(tmp_dir):
        if mpu.get_data_parallel_rank() != 0:
            return None
        state = checkpoint_state(iteration, model, optimizer, lr_scheduler, args)
        return capture_error(_write_state, state, _rank_file(tmp_dir))
    _save_atomically(iteration, args, write)


def _save_atomically(iteration, args, write, latest_tag=None):
    """Rank 0 clears SAVE/iter_N.tmp; every rank runs write(tmp_dir) (returns an error or None); all agree;
    rank 0 renames it to SAVE/iter_N and writes the tracker files (the commit point); all agree again."""
    final_dir = get_checkpoint_dir(args.save, iteration)
    tmp_dir = final_dir + ".tmp"
    error = None
    if dist.get_rank() == 0:
        error = capture_error(_prepare_save_dir, args.save, tmp_dir)
    _agree(error, f"preparing {tmp_dir}")
    error = write(tmp_dir)
    if os.environ.get(KILL_IN_SAVE_ENV) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    _agree(error, f"writing {tmp_dir}")
    error = None
    if dist.get_rank() == 0:
        error = capture_error(_publish, args.save, tmp_dir, final_dir, iteration, args.save_keep_last, latest_tag)
    _agree(error, f"publishing {final_dir}")
    print_rank_0(f"  saved checkpoint at iteration {iteration} to {args.save}")


def _prepare_save_dir(save_dir, tmp_dir):
    os.makedirs(save_dir, exist_ok=True)
    if os.path.exists(tmp_dir):  # left by a save that crashed
        shutil.rmtree(tmp_dir)


def _write_state(state, path):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    atomic_torch_save(state, path)
    _fsync_dir(directory)


def _publish(save_dir, tmp_dir, final_dir, iteration, keep_last, latest_tag=None):
    """Rename tmp_dir to final_dir, then write the tracker (the commit point), then prune old checkpoints.
    Re-saving an iteration that already exists moves the old copy to final_dir.old first; a crash between the
    two renames is recovered by load_checkpoint, which falls back to the .old copy."""
    _fsync_dir(tmp_dir)  # the writers synced their files and mp_rank_* directories
    old_dir = final_dir + ".old"
    if os.path.exists(final_dir):
        if os.path.exists(old_dir):
            shutil.rmtree(old_dir)
        os.replace(final_dir, old_dir)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(save_dir)
    if latest_tag is not None:  # the ZeRO engine's own pointer, then Megatron's tracker
        atomic_write_text(os.path.join(save_dir, LATEST_FILE), latest_tag)
    atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
    _fsync_dir(save_dir)
    if os.path.exists(old_dir):
        shutil.rmtree(old_dir)
    if keep_last:
        _prune(save_dir, iteration, keep_last)


def _prune(save_dir, current, keep_last):
    """Keep `current` and the newest keep_last - 1 other iter_* directories."""
    pattern = re.compile(r"iter_(\d{7})$")
    others = sorted((int(m.group(1)) for m in map(pattern.match, os.listdir(save_dir)) if m), reverse=True)
    others = [it for it in others if it != current]
    for stale in others[keep_last - 1:]:
        shutil.rmtree(get_checkpoint_dir(save_dir, stale))


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(error, what):
    """Every rank raises when any rank failed (see megatron.zero.checkpoint.agree_on_success)."""
    agree_on_success(error, what, mpu.get_device())


# ---------------------------------------------------------------------------------------------------- loading

def get_checkpoint_iteration(args):
    """(iteration, release) from args.load's tracker file, or (None, False) when there is none."""
    tracker = get_checkpoint_tracker_filename(args.load)
    if not os.path.isfile(tracker):
        return None, False
    with open(tracker) as handle:
        text = handle.read().strip()
    if text == RELEASE:
        return 0, True
    if not text.isdigit():
        raise CheckpointError(f"tracker file {tracker} holds {text!r}: expected an iteration number or 'release'")
    return int(text), False


def load_checkpoint(model, optimizer, lr_scheduler, args):
    """Load args.load's tracked checkpoint into model (and optimizer, lr scheduler, RNG, counters on args, as the
    flags allow). Returns the iteration to continue from: 0 when there is no tracker (a one-line notice), with
    --finetune, or for a release checkpoint. Every rank must call it; an error on any rank raises on all."""
    iteration, release = get_checkpoint_iteration(args)
    if iteration is None:
        print_rank_0(f"WARNING: could not find the metadata file {get_checkpoint_tracker_filename(args.load)}; "
                     "will not load any checkpoints and will start from random")
        return 0
    result = {}
    if args.deepspeed:
        error = capture_error(_load_ds_checkpoint, result, model, args, iteration)
        _agree(error, f"loading {os.path.join(args.load, ds_checkpoint_tag(iteration))}")
        print_rank_0(f"  loaded checkpoint from {args.load} at iteration {iteration}")
        return result[ITERATION]
    error = capture_error(_load_into, result, model, optimizer, lr_scheduler, args, iteration, release)
    _agree(error, f"loading {get_checkpoint_dir(args.load, iteration, release)}")
    print_rank_0(f"  loaded checkpoint from {args.load} at iteration {iteration}")
    return result[ITERATION]


def _load_into(result, model, optimizer, lr_scheduler, args, iteration, release):
    path = _checkpoint_path_for_load(args, iteration, release)
    state = safe_torch_load(path)
    missing = [key for key in (ITERATION, MODEL, MODEL_SHAPE) if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a checkpoint written by save_checkpoint")
    _check_model_shape(state[MODEL_SHAPE], args, path)
    try:
        unwrap_model(model).load_state_dict(state[MODEL])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the saved weights do not fit this model: {e}") from None
    fresh = release or args.finetune
    if not fresh and not args.no_load_optim:
        _require(state, (OPTIMIZER, LR_SCHEDULER), path, "--no-save-optim", "--no-load-optim")
        optimizer.load_state_dict(state[OPTIMIZER])
        try:
            lr_scheduler.load_state_dict(state[LR_SCHEDULER])
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 master copies of the weights just loaded
    result[ITERATION] = restore_run_state(state, args, path, fresh)


def _load_ds_checkpoint(result, model, args, iteration):
    """The ZeRO engine loads module, optimizer partitions (re-partitioned for this data-parallel size) and lr
    scheduler; client_state gives back the counters and RNG states."""
    fresh = args.finetune
    load_optimizer = not (fresh or args.no_load_optim)
    directory = get_checkpoint_dir(args.load, iteration)
    if os.path.isfile(_rank_file(directory)):
        raise CheckpointError(f"{directory} holds a Megatron-path checkpoint (saved without --deepspeed): load it "
                              "without --deepspeed, or pass another --load directory")
    try:
        path, client_state = model.load_checkpoint(args.load, ds_checkpoint_tag(iteration),
                                                   load_optimizer_states=load_optimizer,
                                                   load_lr_scheduler_states=load_optimizer)
    except RuntimeError as e:  # a state dict that does not fit this model
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{args.load}/{ds_checkpoint_tag(iteration)}: the saved weights do not fit this "
                              f"model: {e}") from None
    if path is None:
        raise CheckpointError("Unable to load checkpoint.")
    if MODEL_SHAPE in client_state:
        _check_model_shape(client_state[MODEL_SHAPE], args, path)
    result[ITERATION] = restore_run_state(client_state, args, path, fresh)


def restore_run_state(state, args, path, fresh):
    """RNG states (unless --no-load-rng) and the counters on args from a checkpoint's `state` (for the ZeRO path:
    its client_state); `fresh` (--finetune, release) zeroes the counters and keeps this run's RNG.
    Returns the iteration to continue from."""
    if fresh:
        args.consumed_train_samples, args.consumed_valid_samples, args.skipped_iterations = 0, 0, 0
        return 0
    if not args.no_load_rng:
        _require(state, (RNG,), path, "--no-save-rng", "--no-load-rng")
        set_rng_state(state[RNG])
    args.consumed_train_samples = int(state[CONSUMED_TRAIN_SAMPLES])
    args.consumed_valid_samples = int(state[CONSUMED_VALID_SAMPLES])
    args.skipped_iterations = int(state[SKIPPED_ITERATIONS])
    return int(state[ITERATION])


def _checkpoint_path_for_load(args, iteration, release):
    """This rank's file, with errors that say what is there instead."""
    directory = get_checkpoint_dir(args.load, iteration, release)
    tracker = get_checkpoint_tracker_filename(args.load)
    if not os.path.isdir(directory) and os.path.isdir(directory + ".old"):
        print(f"WARNING: {directory} is missing (a re-save was interrupted); loading {directory}.old", flush=True)
        directory += ".old"
    if not os.path.isdir(directory):
        raise CheckpointError(f"tracker file {tracker} names iteration {iteration}, but {directory} does not exist")
    path = _rank_file(directory)
    if not os.path.isfile(path) and any(name.endswith("_model_states.pt") for name in os.listdir(directory)):
        raise CheckpointError(f"{directory} holds a ZeRO checkpoint (saved with --deepspeed): load it with "
                              "--deepspeed --deepspeed_config, or pass another --load directory")
    if not os.path.isfile(path):
        ranks = sorted(name for name in os.listdir(directory) if name.startswith("mp_rank_"))
        raise CheckpointError(f"{path} does not exist: {directory} holds {ranks or 'no mp_rank_* directories'} "
                              f"(model-parallel size {len(ranks)}), this run has model-parallel size "
                              f"{mpu.get_model_parallel_world_size()}")
    return path


def _check_model_shape(saved, args, path):
    ours = model_shape(args)
    diffs = [f"{field} {saved.get(field)} (checkpoint) != {ours[field]} (this run)"
             for field in MODEL_SHAPE_FIELDS if saved.get(field) != ours[field]]
    if diffs:
        raise CheckpointError(f"{path} was saved by another model shape: {'; '.join(diffs)}")


def _require(state, keys, path, saved_flag, load_flag):
    missing = [key for key in keys if key not in state]
    if missing:
        raise CheckpointError(f"{path} has no {', '.join(missing)} (saved with {saved_flag}?): pass {load_flag} "
                              "or --finetune to start it fresh")
