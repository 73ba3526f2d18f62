"""Training-script utilities: logging on rank 0, loss reduction, unwrapping, exit conditions, and
checkpoint save/load for the Megatron path.

Checkpoint layout: SAVE/iter_{:07d}/mp_rank_{:02d}/model_optim_rng.pt and SAVE/latest_checkpointed_iteration.txt.
"""
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

import mpu

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


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
    """Decides, identically on every rank, when training stops early: --exit-interval, or
    --exit-duration-in-mins (rank 0's clock is broadcast so all ranks stop at the same iteration)."""

    def __init__(self, args):
        self.exit_interval = args.exit_interval
        self.exit_duration_secs = None if args.exit_duration_in_mins is None else args.exit_duration_in_mins * 60
        self.start_time = time.time()
        self.reason = None

    def should_exit(self, iteration):
        if self.exit_interval and iteration % self.exit_interval == 0:
            self.reason = f"--exit-interval {self.exit_interval}"
            return True
        if self.exit_duration_secs is not None:
            flag = torch.tensor([1 if time.time() - self.start_time > self.exit_duration_secs else 0],
                                device=mpu.get_device())
            dist.broadcast(flag, 0)
            if flag.item():
                self.reason = "--exit-duration-in-mins"
                return True
        return False


def get_checkpoint_name(checkpoints_path, iteration, release=False, mp_rank=None):
    directory = "release" if release else f"iter_{iteration:07d}"
    rank = mpu.get_model_parallel_rank() if mp_rank is None else mp_rank
    return os.path.join(checkpoints_path, directory, f"mp_rank_{rank:02d}", "model_optim_rng.pt")


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_rng_state():
    """Every RNG state, as tensors and plain values (loadable with weights_only=True)."""
    state = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
             "python_gauss": random.getstate()[2],
             "numpy": _numpy_state(), "torch": torch.get_rng_state(),
             "tracker": mpu.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_rng_state(state):
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mpu.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
    """Every data-parallel rank 0 writes its model-parallel shard; then the tracker file."""
    if mpu.get_data_parallel_rank() == 0:
        state = {"iteration": iteration, "model": unwrap_model(model).state_dict(),
                 "consumed_train_samples": args.consumed_train_samples,
                 "consumed_valid_samples": args.consumed_valid_samples,
                 "skipped_iterations": args.skipped_iterations}
        if not args.no_save_optim:
            state["optimizer"] = optimizer.state_dict()
            state["lr_scheduler"] = lr_scheduler.state_dict()
        if not args.no_save_rng:
            state["rng"] = get_rng_state()
        path = get_checkpoint_name(args.save, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(get_checkpoint_tracker_filename(args.save), "w") as handle:
            handle.write(str(iteration))
        print_rank_0(f"  saved checkpoint at iteration {iteration} to {args.save}")
    dist.barrier()


def get_checkpoint_iteration(args):
    """(iteration, release) from the tracker file, or (None, False) when there is none."""
    tracker = get_checkpoint_tracker_filename(args.load)
    if not os.path.isfile(tracker):
        return None, False
    text = open(tracker).read().strip()
    if text == "release":
        return 0, True
    return int(text), False


def load_checkpoint(model, optimizer, lr_scheduler, args):
    """Returns the iteration to continue from (0 when there is nothing to load)."""
    iteration, release = get_checkpoint_iteration(args)
    if iteration is None:
        print_rank_0(f"WARNING: could not find the metadata file {get_checkpoint_tracker_filename(args.load)}; "
                     "will not load any checkpoints and will start from random")
        return 0
    state = torch.load(get_checkpoint_name(args.load, iteration, release), map_location="cpu", weights_only=True)
    unwrap_model(model).load_state_dict(state["model"])
    if args.finetune or release:
        return 0
    if not args.no_load_optim and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not args.no_load_rng and "rng" in state:
        set_rng_state(state["rng"])
    args.consumed_train_samples = state["consumed_train_samples"]
    args.consumed_valid_samples = state["consumed_valid_samples"]
    args.skipped_iterations = state["skipped_iterations"]
    print_rank_0(f"  loaded checkpoint from {args.load} at iteration {iteration}")
    return state["iteration"]
