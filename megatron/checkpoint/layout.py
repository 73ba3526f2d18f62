"""Checkpoint file names and keys of both layouts (the one place they are spelled), safe loads, checked saves.

    atomic_torch_save(obj, path)   checked (weights_only-safe values only), then atomic: megatron.checkpoint.atomic_io;
                                   returns the file's manifest entry (size, crc32)
    host_copy(state, clone)        the state's tensors in host memory, structure kept (the same file bytes): what
                                   a save writes, and with clone (--async-save) what a background thread writes
    safe_torch_load(path)          verified against its checkpoint directory's manifest (megatron.checkpoint.manifest), then
                                   torch.load(weights_only=True) on the CPU: a checkpoint can never run code.
                                   Store only tensors, python scalars, str, None, and lists/tuples/dicts of those.
    verify_checkpoint_directory    every listed file (or this rank's share), before a load picks a checkpoint

Every checkpoint directory (SAVE/<tag>/ of either layout) holds manifest.json, written last before it is published.

ZeRO layout (written by the engine; DESIGN.md section 6):
    SAVE/<tag>/mp_rank_{mp:02d}_model_states.pt                           module, lr scheduler, steps, client_state
    SAVE/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt         this data-parallel rank's fp32 slice,
                                                                         moments, loss scaler (unpadded); a bf16
                                                                         run's name has DeepSpeed's bf16_ prefix
    SAVE/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt         stage 3: this rank's slice of the 16-bit
                                                                         weights (the module file then holds
                                                                         buffers only, unless
                                                                         stage3_gather_16bit_weights_on_model_save)
    SAVE/latest                                                           the tag, written last
    Under pipelining (P > 1) both names carry the stage, Megatron-style: mp_rank_{mp:02d}_{pp:03d}_model_states.pt,
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_{pp:03d}_optim_states.pt (each stage's parameters under their global names).
Megatron layout (written by megatron.checkpoint.saving):
    SAVE/iter_{:07d}/mp_rank_{mp:02d}/model_optim_rng.pt                  model, optimizer, lr scheduler, RNG
    SAVE/latest_checkpointed_iteration.txt                                the iteration (both paths write it)
"""
import copy
import os
import pickle
import re

import torch

from megatron.checkpoint import manifest
from megatron.cli import UserError
from megatron.checkpoint.deepspeed_classes import NUMPY_GLOBALS, SAFE_GLOBALS, STAND_INS
from megatron.checkpoint.deepspeed_classes import pickle_module as deepspeed_pickle_module
from megatron.checkpoint.atomic_io import atomic_torch_save as _atomic_torch_save
from megatron.checkpoint.atomic_io import atomic_write_text

# ---- ZeRO layout -------------------------------------------------------------------------------------------
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
PIPELINE_PARALLEL_SIZE = "pipeline_parallel_size"   # absent in checkpoints saved before pipelining: 1
EXPERT_MODEL_PARALLEL_SIZE = "expert_model_parallel_size"   # MoE experts split over ranks; absent before MoE: 1
ZERO_STAGE = "zero_stage"              # also a key of the optimizer-states file
STAGE3_PARTITIONS = "stage3_partitions"  # stage 3, saved partitioned: per stage-3 group {"names", "shapes"}; the
                                         # module then holds the buffers only, the weights are in the ranks' files
# Key of the stage-3 per-rank model-states file (stage3_rank_states_name): per stage-3 group this rank's unpadded
# slice {START, END, WEIGHT} of the 16-bit flat (the frozen parameters' group included).
PARTITION_WEIGHTS = "partition_weights"
WEIGHT = "weight"

# Keys of the optimizer-states file (this data-parallel rank's unpadded slice of every param group).
DATA_PARALLEL_RANK = "data_parallel_rank"
LOSS_SCALER = "loss_scaler"
PARAM_GROUPS = "param_groups"          # the optimizer's hyperparameters per group (no params)
GROUPS = "groups"                      # per group: NUMEL, START, END, MASTER, SLICE_STATE, SCALAR_STATE
NUMEL, START, END = "numel", "start", "end"
MASTER = "fp32_master"
SLICE_STATE = "slice_state"            # per-element optimizer state (Adam moments), saved for [start, end)
SCALAR_STATE = "scalar_state"          # everything else (Adam's step count)

# ---- Megatron layout ---------------------------------------------------------------------------------------
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
RELEASE = "release"

# Keys of model_optim_rng.pt (and of the ZeRO path's client_state: ITERATION, the counters, RNG, MODEL_SHAPE).
ITERATION = "iteration"
MODEL = "model"
OPTIMIZER = "optimizer"
RNG = "rng"
CONSUMED_TRAIN_SAMPLES = "consumed_train_samples"
CONSUMED_VALID_SAMPLES = "consumed_valid_samples"
SKIPPED_ITERATIONS = "skipped_iterations"
MODEL_SHAPE = "model_shape"           # MODEL_SHAPE_FIELDS, plus "vocab_size" (the real, unpadded vocabulary)
                                      # and "layernorm_epsilon"
VIRTUAL_PIPELINE_SIZE = "virtual_pipeline_model_parallel_size"   # in MODEL_SHAPE: model chunks per stage (absent: 1);
                                      # which layers each stage's file holds (mpu.pipeline_layer_ranges)
PARAM_NAMES = "param_names"           # per optimizer param group, the parameter names in the group's order
# Fields of MODEL_SHAPE, compared with the loading model's on load at the saving topology.
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "model_parallel_size")
# The Llama-family options (GPT2ModelConfig's names) and their GPT-2 values: recorded by every writer, compared on
# every load; a checkpoint written before they existed holds these values.
ARCHITECTURE_DEFAULTS = {"num_key_value_heads": None, "ffn_hidden_size": None, "swiglu": False,
                         "normalization": "layernorm", "add_bias_linear": True, "learned_position_embeddings": True,
                         "rotary": False, "rotary_theta": 10000.0, "untie_embeddings_and_output_weights": False,
                         "num_experts": None, "moe_router_topk": None}   # MoE (None: dense MLPs)


ITERATION_DIR_PATTERN = re.compile(r"iter_(\d{7})$")


def model_shape_record(num_layers, hidden_size, num_attention_heads, padded_vocab_size, model_parallel_size,
                       vocab_size, layernorm_epsilon, lora=None, architecture=None, max_sequence_length=None):
    """MODEL_SHAPE as every writer stores it (a LoRA run also records its rank and alpha: convert_to_hf merges
    the adapters with them; they are not compared on load). `architecture`: {ARCHITECTURE_DEFAULTS key: value},
    the missing ones at their defaults."""
    shape = {"num_layers": num_layers, "hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
             "padded_vocab_size": padded_vocab_size, "model_parallel_size": model_parallel_size,
             "vocab_size": vocab_size, "layernorm_epsilon": layernorm_epsilon}
    shape.update(architecture_record(architecture or {}))
    if max_sequence_length is not None:   # not compared on load (the position table's rows are)
        shape["max_sequence_length"] = max_sequence_length
    if lora is not None:
        shape.update(lora_rank=lora.rank, lora_alpha=lora.alpha)
    return shape


def architecture_record(values):
    """Every ARCHITECTURE_DEFAULTS key with its value in `values` (a dict or an object with those attributes),
    else its default."""
    get = values.get if isinstance(values, dict) else (lambda key, default: getattr(values, key, default))
    return {key: get(key, default) for key, default in ARCHITECTURE_DEFAULTS.items()}


def check_model_shape(saved, ours, fields, where, strict=True):
    """CheckpointError naming every field of `fields` (and every architecture field of `ours`) where the saved
    MODEL_SHAPE differs from this run's; a field the saved record lacks differs when `strict` (at the saving
    topology), is skipped otherwise; a missing architecture field is its GPT-2 default."""
    saved = dict(architecture_record(saved), **saved)
    fields = list(fields) + [key for key in ARCHITECTURE_DEFAULTS if key in ours and key not in fields]
    diffs = [f"{field} {saved.get(field)} (checkpoint) != {ours[field]} (this run)" for field in fields
             if field in ours and (strict or field in saved) and saved.get(field) != ours[field]]
    if diffs:
        raise CheckpointError(f"{where} was saved by another model shape: {'; '.join(diffs)}")


def iteration_dir_name(iteration):
    """The directory of an iteration's checkpoint (both paths; the ZeRO path's tag)."""
    return f"iter_{iteration:07d}"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint file is missing, unreadable, or holds objects that weights_only loading refuses."""


def rank_dir_name(model_parallel_rank, pipeline_rank=None):
    """mp_rank_{tp:02d}, or mp_rank_{tp:02d}_{pp:03d} under pipelining (pipeline_rank None: P = 1): the Megatron
    layout's per-rank directory (holds CHECKPOINT_FILENAME) and the rank part of the ZeRO layout's file names."""
    return f"mp_rank_{model_parallel_rank:02d}" + ("" if pipeline_rank is None else f"_{pipeline_rank:03d}")


# rank_dir_name's names (groups: tensor rank, pipeline stage or None), alone or as the ZeRO model-states file's
RANK_DIR_PATTERN = re.compile(r"mp_rank_(\d+)(?:_(\d{3}))?$")
MODEL_STATES_PATTERN = re.compile(r"mp_rank_(\d+)(?:_(\d{3}))?_model_states\.pt$")


def model_states_name(model_parallel_rank, pipeline_rank=None):
    return f"{rank_dir_name(model_parallel_rank, pipeline_rank)}_model_states.pt"


def stage3_rank_states_name(data_parallel_rank, model_parallel_rank, pipeline_rank=None):
    """Stage 3's per-rank model-states file (DeepSpeed's name at P = 1): this rank's partition of the weights."""
    return f"zero_pp_rank_{data_parallel_rank}_{model_states_name(model_parallel_rank, pipeline_rank)}"


BF16_PREFIX = "bf16_"   # DeepSpeed's prefix of the optimizer-states files of a bf16 run (its loader looks there)


def optim_states_name(data_parallel_rank, model_parallel_rank, pipeline_rank=None, bf16=False):
    """zero_pp_rank_{dp}_mp_rank_{mp:02d}[_{pp:03d}]_optim_states.pt, with DeepSpeed's bf16_ prefix in a bf16 run."""
    return (BF16_PREFIX if bf16 else "") + \
        f"zero_pp_rank_{data_parallel_rank}_{rank_dir_name(model_parallel_rank, pipeline_rank)}_optim_states.pt"


def find_optim_states_file(directory, data_parallel_rank, model_parallel_rank, pipeline_rank=None):
    """The path of that rank's optimizer-states file in `directory`, with or without the bf16_ prefix (the
    unprefixed path when neither exists)."""
    plain = os.path.join(directory, optim_states_name(data_parallel_rank, model_parallel_rank, pipeline_rank))
    prefixed = os.path.join(directory, optim_states_name(data_parallel_rank, model_parallel_rank, pipeline_rank,
                                                         bf16=True))
    return prefixed if not os.path.isfile(plain) and os.path.isfile(prefixed) else plain


def optim_states_ranks(directory, model_parallel_rank, pipeline_rank=None):
    """Data-parallel ranks that have an optimizer-states file (bf16_ prefixed or not) for `model_parallel_rank`
    (and pipeline stage `pipeline_rank`, None at P = 1) in `directory`."""
    suffix = rank_dir_name(model_parallel_rank, pipeline_rank)
    pattern = re.compile(rf"(?:{BF16_PREFIX})?zero_pp_rank_(\d+)_{suffix}_optim_states\.pt$")
    return sorted({int(m.group(1)) for m in map(pattern.match, os.listdir(directory)) if m})


def atomic_torch_save(obj, path):
    """torch.save(obj, path) so that `path` is either the old file or the complete new one. `obj` is checked
    first (check_weights_only_safe), so a file that safe_torch_load would refuse is never written. A file holding
    stand-ins of DeepSpeed's classes is pickled with their DeepSpeed names (megatron.checkpoint.deepspeed_classes)."""
    stand_ins = check_weights_only_safe(obj, os.path.basename(path))
    pickle_module = deepspeed_pickle_module if stand_ins else None
    return manifest.make_entry(path, *_atomic_torch_save(obj, path, checksum=True, pickle_module=pickle_module))


def host_copy(obj, clone=False):
    """`obj` with every tensor in host memory, the structure kept exactly (shared tensors, shared storages,
    views: storage offset and size, shared containers), so that torch.save writes the same bytes as for `obj`.
    Tensors on a device are copied; host tensors too when `clone` (--async-save: the training loop goes on
    changing the originals while a thread writes the copies; the copies' buffers are reused by the next
    clone), else they are kept (`obj` itself is returned when nothing is on a device)."""
    tensors = {}
    _find_tensors(obj, tensors)
    if not clone and all(t.device.type == "cpu" for t in tensors.values()):
        return obj
    storages, memo = {}, {}
    for key, tensor in tensors.items():
        memo[key] = _tensor_on_host(tensor, storages, clone)
    if clone:           # the next save copies into the same host buffers (no new pages to fault in)
        _reusable.clear()
        _reusable.update(storages)
    return copy.deepcopy(obj, memo)


# --async-save's host buffers, by the storage they copied, kept for the next save (its copy must be written by
# then: save_directory_atomically finishes a save in flight before the next one copies)
_reusable = {}


def _find_tensors(obj, found):
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _find_tensors(key, found)
            _find_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _find_tensors(value, found)


def _bytes_of(storage):
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _tensor_on_host(tensor, storages, clone):
    if tensor.device.type == "cpu" and not clone:
        return tensor
    storage = tensor.untyped_storage()
    host = storages.get(storage._cdata)
    if host is None:       # each storage copied once: tensors sharing one keep sharing it
        host = _reusable.get(storage._cdata) if clone else None
        if host is not None and host.nbytes() == storage.nbytes():
            _bytes_of(host).copy_(_bytes_of(storage))      # a tensor copy: parallel, unlike storage.copy_
        else:
            host = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        storages[storage._cdata] = host
    result = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())
    if tensor.requires_grad:
        result.requires_grad_(True)
    return result


def safe_torch_load(path, map_location="cpu", mmap=False, numpy_arrays=False):
    """torch.load(path, weights_only=True), with one-line errors for missing, empty, truncated, corrupt or
    unsafe files (a checkpoint can never run code). `mmap`: tensors stay in the file until touched, so slicing
    reads only the slice (how every loader reads the pieces it will own). First the file is checked against its
    checkpoint directory's manifest (verify_checkpoint_file): a damaged file is refused, never loaded.
    Inert stand-ins of the classes DeepSpeed pickles are allowed (deepspeed_classes.SAFE_GLOBALS); numpy arrays
    only with `numpy_arrays` (Megatron-DeepSpeed's client state holds numpy's RNG state)."""
    verify_checkpoint_file(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint file {path} is empty")
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint file {path} is corrupt: not a torch.save zip archive")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS + (NUMPY_GLOBALS if numpy_arrays else [])):   # inert stand-ins of DeepSpeed's pickled classes
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed| Please|\n|$)", str(e))
        found = reason.group(1).strip() if reason else "objects other than tensors and plain python values"
        raise CheckpointError(f"refusing to load {path}: weights_only loading found {found} (a checkpoint may "
                              "hold only tensors and plain python values)") from None
    except (RuntimeError, EOFError) as e:
        if "central directory" in str(e) or "zip archive" in str(e):
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupt (unreadable zip archive)") from None
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None


# ---- verification against the manifest -----------------------------------------------------------------------
_verified = {}      # absolute path -> os.stat key of the file when it (or the whole directory) last verified
_warned = set()     # checkpoint directories without a manifest, already announced (one line each per process)


def checkpoint_directory_of(path):
    """The checkpoint directory holding `path` (where its manifest is): the file's directory, or its parent for
    the Megatron layout's mp_rank_XX[_XXX]/model_optim_rng.pt."""
    parent = os.path.dirname(os.path.abspath(path))
    if RANK_DIR_PATTERN.match(os.path.basename(parent)):
        return os.path.dirname(parent)
    return parent


def verify_checkpoint_file(path):
    """CheckpointError naming `path` when it is missing, truncated or damaged according to its checkpoint
    directory's manifest; a directory without one (saved before manifests) is announced once and not checked."""
    directory = checkpoint_directory_of(path)
    absolute = os.path.abspath(path)
    if _verified.get(absolute, False) == _stat_key(absolute):
        return
    try:
        verified = manifest.verify_file(directory, os.path.relpath(absolute, directory).replace(os.sep, "/"))
    except (manifest.ManifestError, OSError) as error:
        raise CheckpointError(str(error)) from None
    if verified:
        _verified[absolute] = _stat_key(absolute)
    else:
        _warn_unverified(directory)


def verify_checkpoint_directory(directory, rank=0, world_size=1):
    """None when every file listed in `directory`'s manifest verifies (this rank checks its share: files rank,
    rank + world_size, ...); the problem as one line otherwise. A directory without a manifest: None, announced."""
    try:
        if not manifest.verify_directory(directory, rank, world_size):
            _warn_unverified(directory)
    except (manifest.ManifestError, OSError) as error:
        return " ".join(str(error).split())
    return None


def mark_directory_verified(directory):
    """Record every file of `directory`'s manifest as verified (after all ranks verified their shares), so that
    loads read only the pieces they need instead of checksumming whole files again."""
    for relname in manifest.read_manifest(directory) or ():
        path = os.path.abspath(os.path.join(directory, relname))
        if _stat_key(path) is not None:
            _verified[path] = _stat_key(path)


def _stat_key(path):
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns, info.st_ino


def _warn_unverified(directory):
    import torch.distributed as dist
    directory = os.path.abspath(directory)
    if directory in _warned:
        return
    _warned.add(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"WARNING: {directory} has no {manifest.MANIFEST_FILENAME} (saved before checkpoints had manifests, "
              "or by DeepSpeed): loading it without checking its files", flush=True)


def checkpoint_dir(checkpoints_path, iteration, release=False):
    """SAVE/iter_{:07d} (or SAVE/release): one checkpoint's directory, both layouts."""
    return os.path.join(checkpoints_path, RELEASE if release else iteration_dir_name(iteration))


def read_latest_tag(load_dir):
    """The tag in `load_dir/latest` (the ZeRO engine's), or None when there is no such file."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def write_latest_tag(save_dir, tag):
    atomic_write_text(os.path.join(save_dir, LATEST_FILE), str(tag))


def read_tracker(load_dir):
    """(iteration, release) from Megatron's tracker file in `load_dir` ("release" reads as (0, True)), or None
    when there is none. CheckpointError when it holds anything else."""
    tracker = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as handle:
        text = handle.read().strip()
    if text == RELEASE:
        return 0, True
    if not text.isdigit():
        raise CheckpointError(f"tracker file {tracker} holds {text!r}: expected an iteration number or 'release'")
    return int(text), False


def write_tracker(save_dir, iteration, release=False):
    """The commit point of a save: Megatron's tracker names the iteration (or "release")."""
    atomic_write_text(os.path.join(save_dir, TRACKER_FILENAME), RELEASE if release else str(iteration))


_SAFE_LEAVES = (torch.Tensor, torch.Size, torch.dtype, torch.device, int, float, bool, str, bytes, type(None))


def _bytes_viewed(tensor):
    """Bytes of storage a non-empty tensor's shape, strides and offset reach."""
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def check_weights_only_safe(obj, name="checkpoint"):
    """Raise CheckpointError naming the first value weights_only loading would refuse (e.g. a numpy array:
    store it as a tensor or a list), or a tensor whose storage no longer backs its shape (freed in place: torch.save
    would write a file that cannot be loaded). Returns whether `obj` holds stand-ins of DeepSpeed's classes (which
    safe_torch_load reads: megatron.checkpoint.deepspeed_classes.SAFE_GLOBALS)."""
    if isinstance(obj, dict):
        found = [check_weights_only_safe(key, f"{name} key") for key in obj]
        found += [check_weights_only_safe(value, f"{name}[{key!r}]") for key, value in obj.items()]
        return any(found)
    if isinstance(obj, (list, tuple)):
        return any([check_weights_only_safe(value, f"{name}[{i}]") for i, value in enumerate(obj)])
    if isinstance(obj, STAND_INS):
        return True
    if torch.is_tensor(obj) and obj.numel() > 0 and obj.untyped_storage().nbytes() < _bytes_viewed(obj):
        raise CheckpointError(f"{name} is a tensor of shape {list(obj.shape)} whose memory is gone (its storage "
                              f"holds {obj.untyped_storage().nbytes()} bytes): a ZeRO-3 parameter read after its "
                              "gather was released? Copy it inside zero.GatheredParameters; nothing was written")
    if not isinstance(obj, _SAFE_LEAVES):
        raise CheckpointError(f"{name} holds a {type(obj).__module__}.{type(obj).__qualname__}, which "
                              "torch.load(weights_only=True) refuses; store tensors, numbers, str, lists or dicts")
    return False


ADAM_KINDS = ("exp_avg", "exp_avg_sq")     # per-element optimizer state of a parameter, by half
MUON_KINDS = ("momentum_buffer",)
