"""Pre-flight agreement (DESIGN.md section 10): before the model is built, every rank computes a digest of what
must be the same everywhere (the arguments that are not per-process, the parsed JSON config, the world layout and
a hash of each source file), the digests are exchanged with one all_gather_object that every rank reaches, and on
any difference every rank raises PreflightError naming each differing key and which ranks hold which value:

    ranks disagree before training: hidden_size: 32 on ranks [0], 64 on ranks [1]
"""
import dataclasses
import hashlib
import os

from megatron.cli import UserError

# Namespace keys that legitimately differ between processes (or are compared in another form): the rank, the local
# rank, the parsed config object (compared as `zero_config.*`) and its file path (only the content must agree).
PER_PROCESS_KEYS = frozenset({"rank", "local_rank", "zero_config", "deepspeed_config"})

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE_ROOTS = ("megatron", "mpu", "pretrain_gpt.py")
_source_digest = None


class PreflightError(UserError, RuntimeError):
    """The ranks were started with different settings or code; the message names every difference."""


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _flatten(f"{prefix}.{key}", value[key], out)
    else:
        out[prefix] = repr(value)


def source_digest():
    """{'source:<relative path>': sha256 prefix} for every .py file under megatron/, mpu/ and pretrain_gpt.py."""
    global _source_digest
    if _source_digest is None:
        paths = []
        for root in SOURCE_ROOTS:
            full = os.path.join(REPO, root)
            if os.path.isfile(full):
                paths.append(full)
            for dirpath, dirnames, filenames in os.walk(full):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
        digest = {}
        for path in paths:
            with open(path, "rb") as handle:
                digest[f"source:{os.path.relpath(path, REPO)}"] = hashlib.sha256(handle.read()).hexdigest()[:16]
        _source_digest = digest
    return dict(_source_digest)


def compute_digest(args):
    """What must agree, as {key: repr(value)}."""
    import torch.distributed as dist
    import mpu
    digest = {}
    for key, value in sorted(vars(args).items()):
        if key not in PER_PROCESS_KEYS:
            digest[key] = repr(value)
    config = getattr(args, "zero_config", None)
    if config is not None:
        as_dict = dataclasses.asdict(config)
        as_dict.pop("source", None)
        _flatten("zero_config", as_dict, digest)
    digest["layout.world_size"] = repr(dist.get_world_size() if dist.is_initialized() else 1)
    if mpu.model_parallel_is_initialized():
        digest["layout.model_parallel"] = repr(mpu.get_model_parallel_world_size())
        digest["layout.data_parallel"] = repr(mpu.get_data_parallel_world_size())
    digest.update(source_digest())
    return digest


def differences(digests):
    """[(key, {value: [ranks]})] for every key whose value is not the same on all ranks (missing = '<absent>')."""
    keys = sorted(set().union(*digests))
    found = []
    for key in keys:
        holders = {}
        for rank, digest in enumerate(digests):
            holders.setdefault(digest.get(key, "<absent>"), []).append(rank)
        if len(holders) > 1:
            found.append((key, holders))
    return found


def describe(found):
    parts = [f"{key}: " + ", ".join(f"{value} on ranks {ranks}" for value, ranks in holders.items())
             for key, holders in found]
    return "ranks disagree before training: " + "; ".join(parts)


def check_agreement(args):
    """One all_gather_object over the world; raises PreflightError on every rank when any digests differ."""
    import torch.distributed as dist
    from megatron.guards import breadcrumbs
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = compute_digest(args)
    digests = [None] * dist.get_world_size()
    with breadcrumbs.collective("preflight all_gather_object"):
        dist.all_gather_object(digests, digest)
    found = differences(digests)
    if found:
        raise PreflightError(describe(found))
