"""Training-script utilities (what the seed tutorial puts here): logging on rank 0, loss reduction across the
data-parallel group, unwrapping a model from its DDP / ZeRO-engine wrappers, and the tutorial's two checkpoint
functions under its names and signatures (save_ds_checkpoint, load_checkpoint). Those only translate the argparse
arguments into megatron.checkpoint's explicit objects: checkpoints (save, load, RNG states, any-topology reading)
are megatron.checkpoint's, which the training loop calls directly.
"""
import torch

import mpu
from megatron import checkpoint
from megatron import print_rank_0, unwrap_model  # noqa: F401  (defined at the root; imported from here too)
from megatron.guards import breadcrumbs
from megatron.train_state import CheckpointOptions, TrainState


def reduce_losses(losses):
    """Average each loss over the data-parallel group; returns a tensor of the averages (detached)."""
    reduced = torch.stack([loss.detach().float() for loss in losses])
    breadcrumbs.all_reduce(reduced, "reduce_losses", group=mpu.get_data_parallel_group())
    return reduced / mpu.get_data_parallel_world_size()


def save_ds_checkpoint(iteration, model, args):
    """The tutorial's save through the ZeRO engine (--deepspeed): iteration and every RNG state (unless
    --no-save-rng) into the engine's client_state, under args.save; megatron.checkpoint.save_ds_checkpoint.
    Only the iteration is known here: the other counters (consumed samples, skipped iterations) are saved as 0,
    so a run resumed from it reads its data from the start; the training loop saves its whole TrainState with
    megatron.checkpoint.save_checkpoint."""
    checkpoint.save_ds_checkpoint(TrainState(iteration=iteration), model, CheckpointOptions.from_args(args))


def load_checkpoint(model, optimizer, lr_scheduler, args):
    """The tutorial's load of args.load (either path: the ZeRO engine loads itself with --deepspeed), restoring
    the RNG states unless --no-load-rng; megatron.checkpoint.load_checkpoint. Returns the TrainState to continue
    from (its .iteration is what the tutorial's version returned; a fresh one when args.load holds no checkpoint)."""
    return checkpoint.load_checkpoint(model, optimizer, lr_scheduler, CheckpointOptions.from_args(args))
