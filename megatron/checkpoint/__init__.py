"""Everything about checkpoints (DESIGN.md section 6), one module per concern:

    layout.py           every file name and key of both layouts, CheckpointError, the safe load, the tracker and
                        `latest` reader/writer, the rank/stage directory names
    atomic_io.py        atomic writes and the atomic, agreed, optionally background save of a whole directory
    manifest.py         every file's size and crc32, written last; verified before a load
    rng.py              every RNG state, captured and restored (preserved_rng_state: around a body)
    saving.py           save_checkpoint (both paths), finalize_async_save
    loading.py          load_checkpoint (both paths, any saving topology, falling back to the newest that verifies)
    reshard.py          SavedCheckpoint: any layout and topology read as full tensors by name, split for another
    partitioning.py     how a parameter is split across model-parallel ranks, by its name; joins and splits
    pipeline_stages.py  a pipelined checkpoint's stage files merged into one view per tensor-parallel rank
    experts.py          where an expert's optimizer state lies in a checkpoint saved under expert parallelism
    reshard_load.py     loading those into this rank's model, optimizer and lr scheduler
    optimizer_kind.py   a checkpoint's optimizer (AdamW or Muon) checked against the run's before its state loads
    full_checkpoint.py  the tools' view: read_full_checkpoint, write_full_checkpoint, resize_checkpoint
    deepspeed_format.py DeepSpeed 0.19.8's ZeRO files read as ours (and re-exports the two below)
    deepspeed_keys.py   DeepSpeed's key names in its files
    deepspeed_writing.py DeepSpeed's contents our engine writes beside its own
    deepspeed_classes.py inert stand-ins of the classes DeepSpeed pickles (weights_only loads read them)
    stage3_module.py    a ZeRO-3 checkpoint's module assembled from the ranks' weight partitions

    train_state = load_checkpoint(model, optimizer, lr_scheduler, CheckpointOptions.from_args(args))
    save_checkpoint(train_state, model, optimizer, lr_scheduler, options)

This package builds on mpu, megatron.train_state and the package root's print_rank_0 and unwrap_model only
(megatron.utils, which wraps save_ds_checkpoint and load_checkpoint with the seed tutorial's signatures, builds on
it); the ZeRO engine (megatron.zero) uses its layout and atomic writes, and is recognised here by its DeepSpeed
API, so no import goes the other way.
"""
from .layout import CheckpointError
from .loading import get_checkpoint_iteration, load_checkpoint, newest_verified_checkpoint
from .rng import get_rng_state, preserved_rng_state, set_rng_state
from .saving import checkpoint_state, finalize_async_save, model_shape, save_checkpoint, save_ds_checkpoint

__all__ = ["CheckpointError", "get_checkpoint_iteration", "load_checkpoint", "newest_verified_checkpoint",
           "get_rng_state", "preserved_rng_state", "set_rng_state", "checkpoint_state", "finalize_async_save",
           "model_shape", "save_checkpoint", "save_ds_checkpoint"]
