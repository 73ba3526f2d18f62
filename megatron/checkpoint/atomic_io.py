"""Files that are either the old version or the complete new one, and ranks that fail together.

Used by every writer that must survive a crash (both checkpoint paths, the dataset index cache, the tokenizer
trainer, the preprocessing tools):

    with atomic_path("out.npy") as tmp:     # write tmp; on success it is fsynced and renamed to out.npy,
        np.save(tmp, array)                 # on an exception it is removed and out.npy is untouched
    atomic_write_text(path, text)           # the same for a small text file (tracker files: write them last)
    publish_directory(tmp_dir, final_dir)   # rename a filled directory into place, keeping final_dir.old
    discard_old_directory(final_dir)        #   until the caller's pointer file names the new one
    readable_directory(final_dir)           # final_dir, or final_dir.old after a crash between the renames
    save_directory_atomically(final_dir, write, commit, ...)   # the protocol both checkpoint paths use,
                                                               # with its manifest (megatron.checkpoint.manifest)
    save_directory_atomically(..., background=True)            # --async-save: the files written in a thread,
    finish_pending_save()                                      #   published here (the next save, load, exit)
    size, crc = atomic_torch_save(obj, path, checksum=True)    # the file's crc32, read back during the fsync

And the collective rule for work where only some ranks can fail (writing files, building an index):

    error = capture_error(write, ...)                  # never raise before the other ranks know
    agree_on_success(error, "writing ckpt", device)    # all meet; if any rank failed, every rank raises
"""
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import sys
import threading

from megatron.checkpoint import manifest

OLD_SUFFIX = ".old"


@contextlib.contextmanager
def atomic_path(path, checksum=None):
    """A temporary name next to `path` to write to; renamed to `path` (after fsync) when the block succeeds.
    `checksum`: a list that receives the file's (size, crc32), read back while the fsync runs."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        if checksum is None:
            _fsync_file(tmp)
        else:
            checksum.append(_fsync_and_checksum(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_torch_save(obj, path, checksum=False, pickle_module=None):
    """torch.save(obj, path) through atomic_path; with `checksum`, returns the file's (size, crc32).
    `pickle_module`: torch.save's (default: pickle)."""
    import torch
    sums = [] if checksum else None
    with atomic_path(path, sums) as tmp:
        torch.save(obj, tmp, **({} if pickle_module is None else {"pickle_module": pickle_module}))
    return sums[0] if checksum else None


def atomic_write_text(path, text, encoding="utf-8"):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding=encoding) as handle:
            handle.write(text)


def fsync_dir(path):
    """Make the names in directory `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path):
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_and_checksum(path):
    """(size, crc32) of `path`, computed in a thread while this one fsyncs it: the read comes from the page cache
    and both release the GIL, so the checksum mostly hides behind the wait for the disk."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as reader:
        checksum = reader.submit(manifest.file_crc32, path)
        _fsync_file(path)
        return checksum.result()


def publish_directory(tmp_dir, final_dir):
    """Rename the complete `tmp_dir` to `final_dir`. An existing `final_dir` (a re-save) moves to
    `final_dir.old` first; call discard_old_directory() once the pointer to final_dir is written."""
    fsync_dir(tmp_dir)
    old_dir = final_dir + OLD_SUFFIX
    if os.path.exists(final_dir):
        if os.path.exists(old_dir):
            shutil.rmtree(old_dir)
        os.replace(final_dir, old_dir)
    os.replace(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def discard_old_directory(final_dir):
    old_dir = final_dir + OLD_SUFFIX
    if os.path.exists(old_dir):
        shutil.rmtree(old_dir)


def readable_directory(final_dir):
    """`final_dir`, or its `.old` copy when a re-save crashed between publish_directory's two renames."""
    if not os.path.isdir(final_dir) and os.path.isdir(final_dir + OLD_SUFFIX):
        print(f"WARNING: {final_dir} is missing (a re-save was interrupted); loading {final_dir}{OLD_SUFFIX}",
              flush=True)
        return final_dir + OLD_SUFFIX
    return final_dir


def prepare_empty_directory(path):
    """Create `path` empty (removing what a crashed attempt left there)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)


def save_directory_atomically(final_dir, write, commit, device, is_rank_0, error_class=RuntimeError,
                              background=False):
    """Every rank calls this; write(tmp_dir) runs on every rank and returns the manifest entries of the files it
    wrote ({"file": path, "size", "crc32"}: what megatron.checkpoint.layout.atomic_torch_save returns), or a
    callable that writes them and returns those entries (the file writes deferred: given host copies of the
    states, it may run in another thread); commit() runs on rank 0 after the rename.

        1. rank 0 empties final_dir.tmp/                                          all agree
        2. every rank: write(final_dir.tmp) (and the callable it returned)        all agree
        3. the entries of all ranks are gathered (all_gather_object); rank 0 checks they cover every file and
           writes final_dir.tmp/manifest.json, the last file of the directory      all agree
        4. rank 0: rename it to final_dir (publish_directory), commit() writes the pointer files (the commit
           point), the .old copy of a re-save is discarded                        all agree
    A crash or an error anywhere leaves the previous checkpoint named by the pointers; an error on any rank
    raises `error_class` on every rank, and a failed write's temporary directory is removed (a full disk gets its
    space back).

    `background` (--async-save): step 2's callable runs in a background thread (only local file writes and
    fsyncs: no collective there, so it cannot deadlock with the training loop's) and this returns at once;
    the rest of step 2's agreement and steps 3-4 (collectives) run on the calling thread at the next
    finish_pending_save(): the next save calls it first, as do loads and the end of training. At most one save
    is in flight. Until then the previous checkpoint stays published, so a crash during the background write
    loses only the new one."""
    finish_pending_save()
    tmp_dir = final_dir + ".tmp"
    written, deferred = [], []

    def step(what, fn):
        error = capture_error(fn)
        label = f"publishing {final_dir}" if what == "publishing" else \
            f"{what} {tmp_dir} (the save failed; the previous checkpoint stays the latest)"
        try:
            agree_on_success(error, label, device, error_class=error_class)
        except Exception:
            if is_rank_0 and what != "publishing":
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise

    def prepare():
        if is_rank_0:
            os.makedirs(os.path.dirname(os.path.abspath(final_dir)), exist_ok=True)
            prepare_empty_directory(tmp_dir)

    def collect():
        result = write(tmp_dir)
        if callable(result):
            deferred.append(result)
        else:
            written.extend(result or ())

    def write_files():
        entries = []
        for files in deferred:
            entries.extend(files() or ())
        return entries

    def write_manifest():
        entries = _gather_entries([dict(entry, file=_relative_name(entry["file"], tmp_dir)) for entry in written])
        if is_rank_0:
            manifest.write_manifest(tmp_dir, entries)

    def publish():
        if is_rank_0:
            publish_directory(tmp_dir, final_dir)
            commit()
            fsync_dir(os.path.dirname(os.path.abspath(final_dir)))
            discard_old_directory(final_dir)

    def finish(background_error=None, entries=()):
        written.extend(entries)
        if background_error is not None:
            step("writing", lambda: _raise(background_error))
        else:
            step("writing", lambda: None)
        step("writing the manifest of", write_manifest)
        step("publishing", publish)

    step("preparing", prepare)
    if not background:
        step("writing", lambda: (collect(), written.extend(write_files())))
        step("writing the manifest of", write_manifest)
        step("publishing", publish)
        return
    step("writing", collect)           # the states' host copies are made here, on this thread
    global _pending
    _pending = _BackgroundSave(final_dir, write_files, finish)


def _raise(error):
    raise error


# How a background save snapshots the states: a forked writer process (Linux), whose memory is a copy-on-write
# image taken at the fork, so nothing is copied before the training loop goes on (pages are copied only as the
# loop writes them, spread over the next steps); else a thread writing host copies made first.
FORK_WRITER = sys.platform.startswith("linux") and hasattr(os, "fork") and \
    os.environ.get("MEGATRON_ASYNC_SAVE_WRITER", "fork") == "fork"


def background_writes_need_copies():
    """Whether a background save needs clones of the host tensors it writes (a thread writer does; a forked
    writer reads its own snapshot)."""
    return not FORK_WRITER


class _BackgroundSave:
    """The one save whose files are being written in the background (save_directory_atomically's `background`):
    by a forked writer process (FORK_WRITER: it writes the files and fsyncs, sends back their manifest entries
    and exits; it never takes part in a collective) or by a thread. A thread waits for it; finish() joins that,
    then agrees, writes the manifest and publishes on the calling thread."""

    def __init__(self, final_dir, write_files, finish):
        self.final_dir, self._finish, self.error, self.entries = final_dir, finish, None, []
        work = self._fork(write_files) if FORK_WRITER else write_files
        # Not a daemon: an exit that skips finish_pending_save() (an exception) still completes the files
        # (never a half-written file), but never publishes them (that needs every rank).
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=False,
                                       name=f"async save of {os.path.basename(final_dir)}")
        self.thread.start()

    @staticmethod
    def _fork(write_files):
        """Fork the writer now (the snapshot); returns the function that waits for it and returns its entries."""
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError as error:          # e.g. ENOMEM under strict overcommit: write now, on this thread
            os.close(read_end)
            os.close(write_end)
            print(f"WARNING: --async-save could not fork its writer ({error}); this save is written "
                  "synchronously (MEGATRON_ASYNC_SAVE_WRITER=thread writes host copies from a thread)", flush=True)
            entries = write_files()
            return lambda: entries
        if pid == 0:                      # the writer: write, report, exit without running any cleanup
            os.close(read_end)
            for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):   # not the trainer's handlers
                signal.signal(number, signal.SIG_DFL)
            status = 0
            try:
                report = {"entries": write_files()}
            except BaseException as error:      # reported to the parent, which raises it on every rank
                report, status = {"error": f"{type(error).__name__}: {error}"}, 1
            with os.fdopen(write_end, "w") as channel:
                json.dump(report, channel)
            os._exit(status)
        os.close(write_end)

        def wait():
            with os.fdopen(read_end) as channel:
                text = channel.read()
            _, status = os.waitpid(pid, 0)
            report = json.loads(text) if text else {}
            if "entries" in report and os.waitstatus_to_exitcode(status) == 0:
                return report["entries"]
            raise OSError(report.get("error") or f"the background checkpoint writer (process {pid}) died "
                          f"(exit status {os.waitstatus_to_exitcode(status)}) before finishing its files")
        return wait

    def _run(self, write_files):
        self.error = capture_error(lambda: self.entries.extend(write_files()))

    def join(self):
        self.thread.join()

    def finish(self):
        self.join()
        self._finish(self.error, self.entries)


_pending = None       # the _BackgroundSave in flight, if any


def pending_save_directory():
    """The directory the background save in flight will publish, or None."""
    return None if _pending is None else _pending.final_dir


def finish_pending_save():
    """Wait for the background save in flight (if any), then agree, write its manifest and publish it. Every rank
    calls it at the same point (it is collective, like the save); a no-op when nothing is in flight. Raises the
    save's error (error_class, on every rank) when any rank's write failed: the previous checkpoint stays."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.finish()


def _relative_name(path, directory):
    """`path` (a file written under `directory`) as the manifest names it: relative, POSIX separators."""
    relname = os.path.relpath(path, directory)
    if relname.startswith(os.pardir):
        raise ValueError(f"{path} was written outside the checkpoint directory {directory}")
    return relname.replace(os.sep, "/")


def _gather_entries(entries):
    """Every rank's `entries`, concatenated in rank order (just `entries` without torch.distributed)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(entries)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(entries))
    return [entry for part in gathered for entry in part]


def capture_error(fn, *args):
    """Run fn(*args); return its exception instead of raising it (the caller must agree with the other ranks
    first, so that no rank is left waiting in a collective)."""
    try:
        fn(*args)
    except Exception as e:  # re-raised on every rank by agree_on_success
        return e
    return None


def agree_on_success(error, what, device, group=None, error_class=RuntimeError):
    """All ranks of `group` meet (one all-reduce on `device`); if any had an error, every rank raises: the
    failing rank its own error (wrapped in `error_class` unless it already is one; as it is when error_class is
    None), the others `error_class` (RuntimeError when None) '<what>: another rank failed (see its message)'.
    Without torch.distributed, just raises a local error."""
    import torch
    import torch.distributed as dist
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        if error_class is None or isinstance(error, error_class):
            raise error
        raise error_class(f"{what}: {type(error).__name__}: {' '.join(str(error).split())}") from error
    if failed.item():
        raise (error_class or RuntimeError)(f"{what}: another rank failed (see its message)")
