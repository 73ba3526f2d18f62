"""print_rank_0 and unwrap_model, the two helpers every layer uses, at the package root (as Megatron-LM's
`from megatron import print_rank_0`): megatron.checkpoint builds on them, and megatron.utils, the seed tutorial's
place for them, re-exports them beside its save_ds_checkpoint and load_checkpoint, which call megatron.checkpoint;
so neither imports the other in a circle. Loads nothing (torch.distributed is imported inside print_rank_0), so
`import megatron.cli` stays a standard-library import for the light tools."""


def print_rank_0(message):
    """Print on global rank 0 only (on every process before torch.distributed is initialized)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def unwrap_model(model):
    """The bare module inside DDP wrappers or the ZeRO engine."""
    while hasattr(model, "module"):
        model = model.module
    return model
