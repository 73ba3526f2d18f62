"""Checkpoint files: atomic writes, safe loads, and the ZeRO engine's file names and keys.

Generic helpers (also used by Megatron's own checkpoint code):
    atomic_torch_save(obj, path)   torch.save to `path.tmp.<pid>`, fsync, then os.replace: a reader never sees a
                                   half-written file, and a crash leaves the previous file intact.
    atomic_write_text(path, text)  the same for small text files (tracker files: write them last).
    safe_torch_load(path)          torch.load(weights_only=True) on the CPU: a checkpoint can never run code.
                                   Store only tensors, python scalars, str, None, and lists/tuples/dicts of those.

ZeRO layout (DESIGN.md section 6):
    SAVE/<tag>/mp_rank_{mp:02d}_model_states.pt                           module, lr scheduler, steps, client_state
    SAVE/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt         this data-parallel rank's fp32 slice,
                                                                         moments, loss scaler (unpadded)
    SAVE/latest                                                           the tag, written last
"""
import os
import pickle
import re

import torch

LATEST_FILE = "latest"

# Keys of the model-states file.
MODULE = "module"
LR_SCHEDULER = "lr_scheduler"
GLOBAL_STEPS = "global_steps"
SKIPPED_STEPS = "skipped_steps"
MICRO_STEPS = "micro_steps"
CLIENT_STATE = "client_state"
DATA_PARALLEL_SIZE = "data_parallel_size"
MODEL_PARALLEL_SIZE = "model_parallel_size"
ZERO_STAGE = "zero_stage"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable, or holds objects that weights_only loading refuses."""


def model_states_name(model_parallel_rank):
    return f"mp_rank_{model_parallel_rank:02d}_model_states.pt"


def optim_states_name(data_parallel_rank, model_parallel_rank):
    return f"zero_pp_rank_{data_parallel_rank}_mp_rank_{model_parallel_rank:02d}_optim_states.pt"


def optim_states_ranks(directory, model_parallel_rank):
    """Data-parallel ranks that have an optimizer-states file for `model_parallel_rank` in `directory`."""
    pattern = re.compile(rf"zero_pp_rank_(\d+)_mp_rank_{model_parallel_rank:02d}_optim_states\.pt$")
    return sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(directory)) if m)


def atomic_torch_save(obj, path):
    """torch.save(obj, path) so that `path` is either the old file or the complete new one.

    `obj` is checked first (check_weights_only_safe), so a file that safe_torch_load would refuse is never written.
    """
    check_weights_only_safe(obj, os.path.basename(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path, text):
    """Write `text` to `path` atomically (temp file + os.replace)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def safe_torch_load(path, map_location="cpu"):
    """torch.load(path, weights_only=True), with one-line errors for missing, empty, truncated, corrupt or
    unsafe files (a checkpoint can never run code)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint file {path} is empty")
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint file {path} is corrupt: not a torch.save zip archive")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed| Please|\n|$)", str(e))
        found = reason.group(1).strip() if reason else "objects other than tensors and plain python values"
        raise CheckpointError(f"refusing to load {path}: weights_only loading found {found} (a checkpoint may "
                              "hold only tensors and plain python values)") from None
    except (RuntimeError, EOFError) as e:
        if "central directory" in str(e) or "zip archive" in str(e):
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupt (unreadable zip archive)") from None
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None


def capture_error(fn, *args):
    """Run fn(*args); return its exception instead of raising it (the caller must agree with the other ranks
    first, so that no rank is left waiting in a collective)."""
    try:
        fn(*args)
    except Exception as e:  # re-raised on every rank by agree_on_success
        return e
    return None


def agree_on_success(error, what, device):
    """All ranks meet (an all-reduce on `device`); if any rank had an error, every rank raises CheckpointError."""
    import torch.distributed as dist
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from error
    if failed.item():
        raise CheckpointError(f"{what}: another rank failed (see its message)")


def read_latest_tag(load_dir):
    """The tag in `load_dir/latest`, or None when there is no such file."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


_SAFE_LEAVES = (torch.Tensor, torch.Size, torch.dtype, torch.device, int, float, bool, str, bytes, type(None))


def check_weights_only_safe(obj, name="checkpoint"):
    """Raise CheckpointError naming the first value weights_only loading would refuse (e.g. a numpy array:
    store it as a tensor or a list)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            check_weights_only_safe(key, f"{name} key")
            check_weights_only_safe(value, f"{name}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_weights_only_safe(value, f"{name}[{i}]")
    elif not isinstance(obj, _SAFE_LEAVES):
        raise CheckpointError(f"{name} holds a {type(obj).__module__}.{type(obj).__qualname__}, which "
                              "torch.load(weights_only=True) refuses; store tensors, numbers, str, lists or dicts")
