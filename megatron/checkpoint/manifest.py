"""Checkpoint manifests: each checkpoint directory lists its files with size and crc32, so that a load can tell
the bytes it reads are the bytes the save wrote (torch.load checks no zip CRC: a flipped byte in a tensor loads).

    SAVE/iter_0000012/manifest.json                 one per checkpoint directory (either layout), written last:
    {"format": "checkpoint-manifest", "version": 1, "checksum": "crc32",
     "files": [{"file": "mp_rank_00/model_optim_rng.pt", "size": 1234, "crc32": "9a0b1c2d"}, ...]}

"file" is relative to the checkpoint directory (POSIX separators); "crc32" is zlib.crc32 of the whole file as
8 hex digits. megatron.checkpoint.atomic_io.save_directory_atomically gathers every rank's entries and writes the manifest
into the temporary directory after all files are written, before the directory is renamed into place; a directory
without one was saved before manifests existed (or by DeepSpeed) and loads unverified.

    entry = file_entry(directory, "mp_rank_00/model_optim_rng.pt")   # {"file", "size", "crc32"}, read back
    write_manifest(directory, entries)       # checks the entries cover exactly the files in `directory`
    verify_file(directory, relname)          # True: verified; False: no manifest; ManifestError: damaged
    verify_directory(directory)              # every listed file (or this rank's share: rank, world_size)

Pure functions of the files (os, json, zlib); no torch, no distributed.
"""
import json
import os
import zlib

from megatron.cli import UserError

MANIFEST_FILENAME = "manifest.json"
FORMAT, VERSION, CHECKSUM = "checkpoint-manifest", 1, "crc32"
CHUNK_BYTES = 8 << 20        # read size for checksums: large enough that crc32 (~3.7 GB/s here) dominates


class ManifestError(UserError):
    """A file disagrees with its directory's manifest, or the manifest is unreadable; the message is one line."""


def file_crc32(path, chunk_bytes=CHUNK_BYTES):
    """(size, crc32) of the file at `path`, read in chunks (constant memory, any file size)."""
    crc, size = 0, 0
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                return size, crc
            crc = zlib.crc32(view[:count], crc)
            size += count


def make_entry(relname, size, crc):
    return {"file": relname, "size": int(size), "crc32": f"{crc & 0xFFFFFFFF:08x}"}


def file_entry(directory, relname):
    """The manifest entry of `directory/relname`, computed from the file."""
    return make_entry(relname, *file_crc32(os.path.join(directory, relname)))


def _files_under(directory):
    """Every file below `directory` but the manifest, relative, POSIX separators, sorted."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            relname = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if relname != MANIFEST_FILENAME:
                found.append(relname)
    return sorted(found)


def write_manifest(directory, entries):
    """Write `directory`/manifest.json listing `entries` (fsynced; no temp name: `directory` is itself still a
    temporary directory that is published by a rename). ValueError when the entries and the files differ."""
    by_name = {entry["file"]: entry for entry in entries}
    on_disk = _files_under(directory)
    unlisted, absent = sorted(set(on_disk) - set(by_name)), sorted(set(by_name) - set(on_disk))
    if unlisted or absent or len(by_name) != len(entries):
        raise ValueError(f"the manifest entries of {directory} do not match its files: written without an entry "
                         f"{unlisted}, entries without a file {absent}, {len(entries) - len(by_name)} duplicates")
    text = json.dumps({"format": FORMAT, "version": VERSION, "checksum": CHECKSUM,
                       "files": [by_name[name] for name in sorted(by_name)]}, indent=1)
    path = os.path.join(directory, MANIFEST_FILENAME)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory):
    """{relname: entry} from `directory`'s manifest, or None when it has none."""
    path = os.path.join(directory, MANIFEST_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("format") != FORMAT or manifest.get("checksum") != CHECKSUM:
            raise ValueError(f"format {manifest.get('format')!r}, checksum {manifest.get('checksum')!r}")
        return {entry["file"]: entry for entry in manifest["files"]}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise ManifestError(f"manifest {path} is damaged ({type(error).__name__}: {error}): restore it from a copy "
                            "of the checkpoint, or delete it to load the checkpoint unverified") from None


def verify_file(directory, relname, entries=None):
    """True when `directory/relname` has the size and crc32 its manifest lists; False when `directory` has no
    manifest; else ManifestError naming the file (missing, not listed, size or crc32 differs). `entries`: the
    read_manifest result, when the caller already has it."""
    entries = read_manifest(directory) if entries is None else entries
    if entries is None:
        return False
    path = os.path.join(directory, relname)
    expected = entries.get(relname)
    if expected is None:
        raise ManifestError(f"checkpoint file {path} is not listed in {os.path.join(directory, MANIFEST_FILENAME)}"
                            ": it was not written by the save; remove it")
    if not os.path.isfile(path):
        raise ManifestError(f"checkpoint file {path} is missing (the manifest lists it, {expected['size']} bytes): "
                            "restore it from a copy, or use an older checkpoint")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise ManifestError(f"checkpoint file {path} is damaged (size {size}, manifest says {expected['size']}): "
                            "truncated or overwritten after the save; use an older checkpoint")
    actual = make_entry(relname, *file_crc32(path))
    if actual["crc32"] != expected["crc32"]:
        raise ManifestError(f"checkpoint file {path} is damaged (crc32 {actual['crc32']}, manifest says "
                            f"{expected['crc32']}): its bytes changed after the save; use an older checkpoint")
    return True


def verify_directory(directory, rank=0, world_size=1):
    """verify_file for the listed files number rank, rank + world_size, ... (every file when world_size is 1, so
    that `world_size` processes together read each file once). True, False (no manifest) or ManifestError."""
    entries = read_manifest(directory)
    if entries is None:
        return False
    for relname in sorted(entries)[rank::world_size]:
        verify_file(directory, relname, entries)
    return True
