"""Checkpoint integrity (DESIGN.md section 6): every checkpoint directory's manifest.json lists exactly its files
with the sizes and crc32 an independent reading of the bytes gives (all ranks' files, both layouts), and an entry
whose file is not there is refused; a flipped byte in the middle of the newest checkpoint's file, a truncated shard
and a missing file are refused naming the file, and `--load DIR` falls back to the previous checkpoint (of several,
the newest older one that verifies), saying which it skipped and why; a checkpoint without a manifest loads with
one warning line; a disk that fills up mid-save (ENOSPC, simulated) leaves the previous checkpoint published,
tracked and verifying, with one error line and exit status 1; the tools refuse damage too.
"""
import contextlib
import io
import json
import os
import re
import sys
import zlib

import pytest
import torch
import torch.distributed as dist

from megatron.checkpoint import atomic_io, manifest
from megatron.spawn import free_port, run_distributed
from megatron.checkpoint import layout as ckpt
from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE, write_config
from tests import warm_python

sys.path.insert(0, os.path.join(REPO, "tools"))

import zero_to_fp32  # noqa: E402

ARGS = MOCK_VOCAB + TINY_SHAPE + ["--batch-size", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "100", "--eval-iters", "0", "--lr", "1e-3", "--warmup", "0",
        "--seed", "7", "--train-iters", "4", "--save-interval", "2"]        # checkpoints at iterations 2 and 4
OLD, NEW = "iter_0000002", "iter_0000004"


# ---------------------------------------------------------------------------------------------- helpers
def _zero_flags(directory):
    return ["--deepspeed", "--deepspeed_config", write_config(directory)]


def _files_on_disk(directory):
    return sorted(os.path.relpath(os.path.join(root, name), directory) for root, _, names in os.walk(directory)
                  for name in names if name != manifest.MANIFEST_FILENAME)


def _assert_manifest_is_the_files(directory):
    """The manifest lists exactly the files on disk, each with its size and zlib.crc32 of all its bytes."""
    with open(os.path.join(directory, manifest.MANIFEST_FILENAME)) as handle:
        listed = {entry["file"]: entry for entry in json.load(handle)["files"]}
    assert sorted(listed) == _files_on_disk(directory)
    for name, entry in listed.items():
        data = open(os.path.join(directory, name), "rb").read()
        assert (entry["size"], entry["crc32"]) == (len(data), f"{zlib.crc32(data):08x}"), name
    return sorted(listed)


def _flip_middle_byte(path):
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 1000)


# ---------------------------------------------------------------------------------------------- manifest.py
def test_manifest_lists_sizes_and_crc32_and_refuses_each_kind_of_damage(tmp_path):
    directory = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(directory, "mp_rank_00"))
    payloads = {"a.pt": os.urandom(3 * 1024 + 5), "mp_rank_00/b.pt": os.urandom(1001)}
    for name, data in payloads.items():
        open(os.path.join(directory, name), "wb").write(data)
    assert manifest.file_crc32(os.path.join(directory, "a.pt"), chunk_bytes=7) == \
        (len(payloads["a.pt"]), zlib.crc32(payloads["a.pt"]))                    # streamed == in one call
    entries = [manifest.file_entry(directory, name) for name in payloads]
    with pytest.raises(ValueError, match=r"written without an entry \['mp_rank_00/b.pt'\]"):
        manifest.write_manifest(directory, entries[:1])                        # every file must be listed
    manifest.write_manifest(directory, entries)
    assert _assert_manifest_is_the_files(directory) == sorted(payloads)
    assert manifest.verify_directory(directory) is True
    b = os.path.join(directory, "mp_rank_00", "b.pt")
    _flip_middle_byte(b)
    assert manifest.verify_file(directory, "a.pt") is True
    crc = f"{zlib.crc32(payloads['mp_rank_00/b.pt']):08x}"
    with pytest.raises(manifest.ManifestError, match=rf"checkpoint file {b} is damaged \(crc32 [0-9a-f]{{8}}, "
                                                     rf"manifest says {crc}\)"):
        manifest.verify_directory(directory)
    assert manifest.verify_directory(directory, rank=0, world_size=2) is True    # rank 0's share: a.pt only
    with pytest.raises(manifest.ManifestError, match="b.pt is damaged"):
        manifest.verify_directory(directory, rank=1, world_size=2)
    os.truncate(b, 1000)
    with pytest.raises(manifest.ManifestError, match=rf"{b} is damaged \(size 1000, manifest says 1001\)"):
        manifest.verify_file(directory, "mp_rank_00/b.pt")
    os.remove(b)
    with pytest.raises(manifest.ManifestError, match=rf"{b} is missing \(the manifest lists it, 1001 bytes\)"):
        manifest.verify_file(directory, "mp_rank_00/b.pt")
    with pytest.raises(manifest.ManifestError, match="c.pt is not listed"):
        manifest.verify_file(directory, "c.pt")
    open(os.path.join(directory, manifest.MANIFEST_FILENAME), "w").write("{not json")
    with pytest.raises(manifest.ManifestError, match="manifest .*manifest.json is damaged"):
        manifest.verify_file(directory, "a.pt")
    os.remove(os.path.join(directory, manifest.MANIFEST_FILENAME))
    assert manifest.verify_directory(directory) is False                       # an old checkpoint: unverified


def test_a_manifest_entry_without_its_file_is_refused(tmp_path):
    """write_manifest refuses an entry whose file is not in the directory (a rank's file lost before the
    manifest), naming the file, and writes no manifest."""
    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    open(os.path.join(directory, "a.pt"), "wb").write(b"abc")
    entries = [manifest.file_entry(directory, "a.pt"), manifest.make_entry("mp_rank_01/gone.pt", 10, 0)]
    with pytest.raises(ValueError, match=re.escape(f"the manifest entries of {directory} do not match its files: "
                                                   "written without an entry [], entries without a file "
                                                   "['mp_rank_01/gone.pt'], 0 duplicates")):
        manifest.write_manifest(directory, entries)
    assert not os.path.exists(os.path.join(directory, manifest.MANIFEST_FILENAME))


def _checkpoint_with_manifest(save_dir, iteration):
    """A checkpoint directory of `iteration` holding one rank file (distinct bytes) and its manifest."""
    directory = ckpt.checkpoint_dir(save_dir, iteration)
    os.makedirs(os.path.join(directory, "mp_rank_00"))
    with open(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"), "wb") as handle:
        handle.write(bytes(range(256)) * (iteration + 1))
    manifest.write_manifest(directory, [manifest.file_entry(directory, "mp_rank_00/model_optim_rng.pt")])
    return directory


def test_fallback_is_the_newest_older_checkpoint_that_verifies(tmp_path, capsys):
    """Checkpoints at 2, 4 and 6, the tracked 6 damaged: the load falls back to 4 (not the oldest, 2); with 4
    damaged too, to 2."""
    from megatron.checkpoint.loading import newest_verified_checkpoint
    save_dir = str(tmp_path / "save")
    directories = {it: _checkpoint_with_manifest(save_dir, it) for it in (2, 4, 6)}
    assert newest_verified_checkpoint(save_dir, 6, False) == (6, False)
    _flip_middle_byte(os.path.join(directories[6], "mp_rank_00", "model_optim_rng.pt"))
    capsys.readouterr()
    assert newest_verified_checkpoint(save_dir, 6, False) == (4, False)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].startswith(f"WARNING: skipping checkpoint {directories[6]}: ")
    assert printed[1] == f"loading {directories[4]} instead: the newest checkpoint in {save_dir} that verifies"
    _flip_middle_byte(os.path.join(directories[4], "mp_rank_00", "model_optim_rng.pt"))
    assert newest_verified_checkpoint(save_dir, 6, False) == (2, False)


def test_an_unwritable_save_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ckpt.CheckpointError) as raised:
        atomic_io.save_directory_atomically(str(blocker / "iter_0000001"), lambda d: [], lambda: None,
                                            torch.device("cpu"), is_rank_0=True, error_class=ckpt.CheckpointError)
    assert str(raised.value).count("\n") == 0 and "preparing" in str(raised.value)


# ---------------------------------------------------------------------------------------------- both layouts
def _load(args, save_dir):
    """Fresh model/optimizer loading `save_dir`: (counters, rank 0's weights, what rank 0 printed)."""
    from megatron.utils import unwrap_model
    from tests.checkpoint.test_checkpoint_files import _fresh_load
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model, _, _, counters = _fresh_load(args, load=save_dir)
    return counters[0], unwrap_model(model).state_dict(), out.getvalue()


def _saved_weights(directory, zero):
    if zero:
        return torch.load(os.path.join(directory, "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    return torch.load(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"), weights_only=True)["model"]


def _saved_file(directory, zero):
    return os.path.join(directory, "mp_rank_00_model_states.pt" if zero else "mp_rank_00/model_optim_rng.pt")


def _train(args_list):
    import pretrain_gpt
    return pretrain_gpt.main(args_list)


def _damage_on_rank_0(fn, path):
    if dist.get_rank() == 0:
        fn(path)
    dist.barrier()


def _fallback_checks(save_dir, flags, zero, damaged_files):
    """Train 4 iterations saving at 2 and 4, then load under each kind of damage to iteration 4's files."""
    import pretrain_gpt
    from megatron.global_vars import get_args
    pretrain_gpt.main(ARGS + flags + ["--save", save_dir])
    args = get_args()
    new, old = os.path.join(save_dir, NEW), os.path.join(save_dir, OLD)
    pristine = {path: open(path, "rb").read() for path in damaged_files + [_saved_file(old, zero)]}

    iteration, _, printed = _load(args, save_dir)                           # intact: the newest, silently
    assert iteration == 4 and "WARNING" not in printed
    for damage, why in ((_flip_middle_byte, r"damaged \(crc32 [0-9a-f]{8}, manifest says [0-9a-f]{8}\)"),
                        (_truncate, r"damaged \(size \d+, manifest says \d+\)"), (os.remove, "is missing")):
        for path in damaged_files:
            _damage_on_rank_0(damage, path)
            iteration, weights, printed = _load(args, save_dir)
            assert iteration == 2 and all(torch.equal(weights[k], v) for k, v in _saved_weights(old, zero).items())
            if dist.get_rank() == 0:
                assert f"WARNING: skipping checkpoint {new}: checkpoint file {path} " in printed, printed
                assert re.search(why, printed), printed
                assert f"loading {old} instead" in printed
                with pytest.raises(ckpt.CheckpointError, match=re.escape(f"checkpoint file {path} ")):
                    ckpt.safe_torch_load(path)                          # what every reader (the tools) calls
                with open(path, "wb") as handle:
                    handle.write(pristine[path])
            dist.barrier()

    if dist.get_rank() == 0:                                             # both damaged: refused, never loaded
        _flip_middle_byte(damaged_files[0])
        _flip_middle_byte(_saved_file(old, zero))
    dist.barrier()
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"no checkpoint in {save_dir} verifies ({NEW}: ") + ".*; "
                       + re.escape(f"{OLD}: checkpoint file")):
        _load(args, save_dir)
    dist.barrier()
    if dist.get_rank() == 0:                                             # an old checkpoint: one warning line
        for path in (damaged_files[0], _saved_file(old, zero)):
            with open(path, "wb") as handle:
                handle.write(pristine[path])
        os.remove(os.path.join(new, manifest.MANIFEST_FILENAME))
    dist.barrier()
    iteration, weights, printed = _load(args, save_dir)
    assert iteration == 4
    if dist.get_rank() == 0:
        assert [line for line in printed.splitlines() if "WARNING" in line] == \
            [f"WARNING: {new} has no manifest.json (saved before checkpoints had manifests, or by DeepSpeed): "
             "loading it without checking its files"]


def test_megatron_path_manifest_and_fallback(tmp_path):
    save_dir = str(tmp_path / "save")
    path = os.path.join(save_dir, NEW, "mp_rank_00", "model_optim_rng.pt")
    run_distributed(_fallback_checks, 2, args=(save_dir, [], False, [path]))
    assert _assert_manifest_is_the_files(os.path.join(save_dir, OLD)) == ["mp_rank_00/model_optim_rng.pt"]


def test_zero_path_manifest_covers_every_rank_and_fallback(tmp_path):
    save_dir = str(tmp_path / "save")
    files = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # zero_pp_rank_0's file is in data-parallel rank 1's share of the checksumming (files 1, 3, ...), rank 1's in
    # rank 0's: a problem found by either rank is reported by rank 0.
    damaged = [os.path.join(save_dir, NEW, name) for name in files[1:]]
    run_distributed(_fallback_checks, 2, args=(save_dir, _zero_flags(str(tmp_path)), True, damaged))
    assert _assert_manifest_is_the_files(os.path.join(save_dir, OLD)) == files
    assert open(os.path.join(save_dir, ckpt.LATEST_FILE)).read() == NEW


def test_tools_refuse_a_damaged_checkpoint_and_resize_writes_a_manifest(tmp_path, capsys):
    from megatron.checkpoint.full_checkpoint import resize_checkpoint
    from megatron.checkpoint.reshard import SavedCheckpoint
    save_dir = str(tmp_path / "save")
    run_distributed(_train, 1, args=(ARGS + ["--save", save_dir],))
    resized = resize_checkpoint(SavedCheckpoint(save_dir), str(tmp_path / "mp2"), 2, deepspeed=True)
    assert _assert_manifest_is_the_files(resized) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                                      "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                      "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    path = os.path.join(save_dir, NEW, "mp_rank_00", "model_optim_rng.pt")
    _flip_middle_byte(path)
    output = str(tmp_path / "fp32.pt")
    assert zero_to_fp32.main([save_dir, output]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint file {path} is damaged (crc32" in err
    assert not os.path.exists(output)
    assert zero_to_fp32.main([save_dir, output, "-t", OLD]) == 0 and os.path.exists(output)


# ---------------------------------------------------------------------------------------------- disk full
ENOSPC_RUNNER = """
import errno, os, runpy, sys, torch
real_save = torch.save
def save_until_the_disk_is_full(obj, f, *args, **kwargs):
    if "iter_0000004" in str(f):          # the second save: half a file, then the disk is full
        with open(f, "wb") as handle:
            handle.write(b"PK\\x03\\x04" + bytes(4096))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return real_save(obj, f, *args, **kwargs)
torch.save = save_until_the_disk_is_full
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


@pytest.mark.parametrize("zero", [False, True], ids=["megatron", "zero"])
def test_disk_full_mid_save_keeps_the_previous_checkpoint(tmp_path, zero):
    save_dir = str(tmp_path / "save")
    flags = _zero_flags(str(tmp_path)) if zero else []
    env = dict(os.environ, MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0")
    result = warm_python.run([sys.executable, "-c", ENOSPC_RUNNER] + ARGS + flags + ["--save", save_dir], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: writing ") and "No space left on device" in errors[0], \
        result.stderr[-3000:]
    assert sorted(os.listdir(save_dir)) == sorted([OLD, ckpt.TRACKER_FILENAME] + ([ckpt.LATEST_FILE] if zero else []))
    assert open(os.path.join(save_dir, ckpt.TRACKER_FILENAME)).read() == "2"
    if zero:
        assert open(os.path.join(save_dir, ckpt.LATEST_FILE)).read() == OLD
    assert manifest.verify_directory(os.path.join(save_dir, OLD)) is True
    _assert_manifest_is_the_files(os.path.join(save_dir, OLD))
