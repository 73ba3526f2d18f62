"""Checkpoint save/load throughput of megatron.utils (atomic, fsynced, weights_only) next to plain torch.save /
torch.load of the same tensors, for the tiny test model and a ~1 GB model state (fp32 weights + Adam moments).

    python tools/bench/bench_checkpoint.py                          # both sizes, 3 alternated repeats, temp dir
    python tools/bench/bench_checkpoint.py --sizes small --repeats 5 --dir /scratch/bench

Columns (MB/s of the checkpoint file's size, median over repeats; every save writes a new file, and the two
ways alternate which runs first, so page-cache state and machine load affect both alike):
    plain save        torch.save(checkpoint_state(...), path)    (no fsync: the page cache may still hold it)
    plain save+fsync  the same, then os.fsync                    (what durability costs by itself)
    ours save         save_checkpoint: temp dir, fsync, all ranks agree, rename, tracker
    plain load        torch.load(path, weights_only=True)
    plain load+apply  the same, then model/optimizer/scheduler load_state_dict (the copies any resume makes)
    ours load         load_checkpoint: checks, weights_only load, and copying into model, optimizer, scheduler, RNG
Ratios: ours save / plain save (and / plain save+fsync); ours load / plain load+apply.
Target: >= 0.8x (atomicity must not cost more).

A second table is --async-save's blocking time: save_checkpoint synchronously next to save_checkpoint with
async_save (the training loop waits only for the snapshot: a forked writer process's copy-on-write image, the
default on Linux, or host copies for a writer thread), and the time until that save is published (megatron.checkpoint.atomic_io.finish_pending_save right after: the rest of the write, the
manifest, the rename). Target: blocking <= 10% of the synchronous save at ~1 GB.

`--reshard` adds a table: the same mp-1 checkpoint loaded by fresh processes at model-parallel 1 (the
saving size: the path's own loader) and at 2 and 4 (megatron.checkpoint.reshard, reading only the overlapping pieces of the
memory-mapped shards): seconds per process (median over repeats), and per process its anonymous resident memory
(RssAnon; the touched pages of a memory-mapped file are page cache), the bytes it owns (weights + Adam moments of
its shard), the peak growth during the load (sampled every 2 ms), and the largest tensor.
Targets: resharding <= 1.5x the plain load's time; growth <= the largest tensor (the share itself was allocated
when the model and optimizer were built).

A third table is the manifest's cost (megatron.checkpoint.manifest: size and crc32 of every file, written last): the same
state saved with megatron.checkpoint.atomic_io.atomic_torch_save with and without its checksum (read back in a thread while
the file is fsynced), back to back, alternating which goes first ("added": median of the pairs' relative
difference); and the crc32 of the saved file by itself (page cache, no overlap: the cost if it were computed after
the save), as a fraction of the save. Target: the added time <= 5%.
"""
import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mpu  # noqa: E402
from bench_common import init_single_process  # noqa: E402
from megatron.learning_rates import AnnealingLR  # noqa: E402
from megatron.model import GPT2Model, GPT2ModelConfig  # noqa: E402
from megatron.train_state import CheckpointOptions, TrainState  # noqa: E402
from megatron.checkpoint import checkpoint_state, load_checkpoint, save_checkpoint  # noqa: E402

SIZES = {  # name: (layers, hidden, heads, vocab, seq)
    "small": (2, 32, 4, 64, 16),
    "1gb": (8, 768, 12, 32768, 1024),   # ~82M parameters: 4 B weights + 8 B Adam moments = ~1 GB
}


def build(layers, hidden, heads, vocab, seq):
    model = GPT2Model(GPT2ModelConfig(num_layers=layers, vocab_size=vocab, hidden_size=hidden,
                                      num_attention_heads=heads, max_sequence_length=seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # creates the Adam moments
    optimizer.zero_grad()
    scheduler = AnnealingLR(optimizer, max_lr=1e-4, min_lr=0.0, warmup_iter=0, decay_iters=100,
                            decay_style="linear")
    return model, optimizer, scheduler


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_save(state, path, fsync):
    with open(path, "wb") as handle:
        torch.save(state, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())


def plain_load_and_apply(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])


def bench(name, repeats, root):
    """Every save writes a new file (as a new iteration's checkpoint does); plain and ours alternate which goes
    first. Returns (file size in bytes, {column: MB/s})."""
    model, optimizer, scheduler = build(*SIZES[name])
    save_dir = os.path.join(root, f"ours_{name}")
    options = CheckpointOptions(save=save_dir, load=save_dir)
    times = {key: [] for key in ("plain save", "plain save+fsync", "ours save", "plain load", "plain load+apply",
                                 "ours load")}
    size = None
    for repeat in range(repeats):
        iteration = repeat + 1
        train_state = TrainState(iteration=iteration)
        plain_path = os.path.join(root, f"plain_{name}_{iteration}.pt")

        def run_plain():
            for fsync in (False, True):
                times["plain save+fsync" if fsync else "plain save"].append(timed(lambda: plain_save(
                    checkpoint_state(train_state, model, optimizer, scheduler, options), plain_path, fsync)))
                if not fsync:
                    os.remove(plain_path)
            times["plain load"].append(timed(lambda: torch.load(plain_path, map_location="cpu", weights_only=True)))
            times["plain load+apply"].append(timed(lambda: plain_load_and_apply(plain_path, model, optimizer,
                                                                                scheduler)))
            os.remove(plain_path)

        def run_ours():
            times["ours save"].append(timed(lambda: save_checkpoint(train_state, model, optimizer, scheduler, options)))
            times["ours load"].append(timed(lambda: load_checkpoint(model, optimizer, scheduler, options)))

        for run in ((run_plain, run_ours) if repeat % 2 == 0 else (run_ours, run_plain)):
            run()
        directory = os.path.join(save_dir, f"iter_{iteration:07d}")
        size = os.path.getsize(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"))
        shutil.rmtree(directory)  # retention is not what we measure
    shutil.rmtree(save_dir)
    return size, {key: size / 1e6 / statistics.median(values) for key, values in times.items()}


def bench_manifest(name, repeats, root):
    """Seconds (medians): atomic save without / with the checksum, and crc32 of the file alone; "added": the
    median over repeats of (with - without) / without, each pair run back to back. Returns (size, {column: value})."""
    from megatron.checkpoint import atomic_io, manifest
    model, optimizer, scheduler = build(*SIZES[name])
    state = checkpoint_state(TrainState(iteration=1), model, optimizer, scheduler, CheckpointOptions())
    times = {"save": [], "save+checksum": [], "crc32 alone": []}
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for checksum in order:
            path = os.path.join(root, f"manifest_{name}_{repeat}_{checksum}.pt")
            times["save+checksum" if checksum else "save"].append(
                timed(lambda: atomic_io.atomic_torch_save(state, path, checksum=checksum)))
            if checksum:
                times["crc32 alone"].append(timed(lambda: manifest.file_crc32(path)))
            size = os.path.getsize(path)
            os.remove(path)
    added = statistics.median((both - save) / save for save, both in zip(times["save"], times["save+checksum"]))
    return size, {"added": added, **{key: statistics.median(values) for key, values in times.items()}}


def bench_async(name, repeats, root, fork_writer=True):
    """Seconds (medians): synchronous save_checkpoint; with async_save, until it returns (blocking) and until
    finish_pending_save() returns after it (published); the two alternate which goes first. `fork_writer`:
    the background writer is a forked process (the default on Linux), else a thread writing host copies.
    Returns (size, {column: seconds})."""
    from megatron.checkpoint import atomic_io
    atomic_io.FORK_WRITER = fork_writer
    model, optimizer, scheduler = build(*SIZES[name])
    times = {"sync": [], "blocking": [], "published": []}
    size = None
    for repeat in range(repeats):
        for background in ((False, True) if repeat % 2 == 0 else (True, False)):
            save_dir = os.path.join(root, f"async_{name}_{repeat}_{background}")
            options = CheckpointOptions(save=save_dir, async_save=background)
            with contextlib.redirect_stdout(io.StringIO()):
                blocking = timed(lambda: save_checkpoint(TrainState(iteration=1), model, optimizer, scheduler,
                                                         options))
                finishing = timed(atomic_io.finish_pending_save)
            if background:
                times["blocking"].append(blocking)
                times["published"].append(blocking + finishing)
            else:
                times["sync"].append(blocking)
            size = os.path.getsize(os.path.join(save_dir, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"))
            shutil.rmtree(save_dir)
    return size, {key: statistics.median(values) for key, values in times.items()}


def print_async_table(rows):
    columns = ["state", "writer", "MB", "sync save s", "async blocking s", "blocking/sync", "async until published s"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for name, writer, size, seconds in rows:
        cells = [name, writer, f"{size / 1e6:.1f}", f"{seconds['sync']:.3f}", f"{seconds['blocking']:.3f}",
                 f"{seconds['blocking'] / seconds['sync']:.1%}", f"{seconds['published']:.3f}"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def print_manifest_table(rows):
    columns = ["state", "MB", "save s", "save+checksum s", "added", "crc32 alone s", "crc32 GB/s", "crc32/save"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for name, size, seconds in rows:
        save, both, alone = seconds["save"], seconds["save+checksum"], seconds["crc32 alone"]
        cells = [name, f"{size / 1e6:.1f}", f"{save:.3f}", f"{both:.3f}", f"{seconds['added']:+.1%}",
                 f"{alone:.3f}", f"{size / 1e9 / alone:.2f}", f"{alone / save:.1%}"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def _reshard_worker(name, load_dir, repeats):
    """In a fresh process at this model-parallel size: build, then time load_checkpoint of load_dir and sample its
    anonymous memory (RssAnon: the file pages a memory-mapped load touches are page cache, not counted)."""
    times, growth = [], []
    model, optimizer, scheduler = build(*SIZES[name])
    share = sum(p.numel() * 4 * 3 for p in model.parameters())          # weights + exp_avg + exp_avg_sq, fp32
    largest = max(p.numel() * 4 for p in model.parameters()) * mpu.get_model_parallel_world_size()

    def load():
        with contextlib.redirect_stdout(io.StringIO()):
            times.append(timed(lambda: load_checkpoint(model, optimizer, scheduler, CheckpointOptions(load=load_dir))))
    for _ in range(repeats):
        growth.append(_peak_anon_growth_mb(load))
    return {"seconds": statistics.median(times), "anon": _rss_anon_mb(), "share": share / 1e6,
            "growth": max(growth), "largest": largest / 1e6}


def _rss_anon_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon:"))


class LinearStack(torch.nn.Module):
    """`layers` square Linear layers (the ZeRO-3 memory rows: one unit per layer, tensors of hidden^2)."""

    def __init__(self, layers, hidden):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _peak_anon_growth_mb(fn):
    """fn(); the peak growth of this process's RssAnon while it ran (sampled every 2 ms)."""
    import gc
    import threading
    gc.collect()
    before, peak, done = _rss_anon_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_mb())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss_anon_mb()) - before


def zero3_memory_worker(save_dir, layers, hidden, gather):
    """One data-parallel rank of a ZeRO-3 engine (fp32, torch AdamW) over the whole world: after one step, the
    peak anonymous-memory growth of save_checkpoint, then of a fresh engine's load_checkpoint. `gather`:
    stage3_gather_16bit_weights_on_model_save (data-parallel rank 0 then gathers the whole model to save it).
    Returns MB: save and load growth, this rank's share (the bytes of its slices in the checkpoint: weights,
    fp32 master and both Adam moments, 16 B per parameter / dp) and the largest tensor."""
    from megatron import zero
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": gather}}

    def engine():
        model = LinearStack(layers, hidden)
        return zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                               config=config)[0]
    first = engine()
    first.backward(first(torch.ones(1, hidden)))
    first.step()
    with contextlib.redirect_stdout(io.StringIO()):
        save = _peak_anon_growth_mb(lambda: first.save_checkpoint(save_dir, tag="t"))
    first = None        # freed before the loading engine is built
    second = engine()
    with contextlib.redirect_stdout(io.StringIO()):
        load = _peak_anon_growth_mb(lambda: second.load_checkpoint(save_dir, tag="t"))
    parameters = layers * (hidden * hidden + hidden)
    return {"save": save, "load": load, "share": 16 * parameters / dist.get_world_size() / 1e6,
            "largest": 4 * hidden * hidden / 1e6}


def bench_zero3_memory(root, layers=8, hidden=1024):
    """Rows (dp, gather, per-rank results) at dp 2 and 4, partitioned and gathered saves."""
    from megatron.spawn import run_distributed
    rows = []
    for world in (2, 4):
        for gather in (False, True):
            directory = os.path.join(root, f"zero3_dp{world}_{gather}")
            results = run_distributed(zero3_memory_worker, world, args=(directory, layers, hidden, gather),
                                      model_parallel_size=1, timeout=1800)
            rows.append((world, gather, results))
            shutil.rmtree(directory, ignore_errors=True)
    return rows


def print_zero3_memory_table(rows):
    columns = ["dp", "save", "share MB/rank", "largest tensor MB", "bound MB", "save growth MB (max rank)",
               "load growth MB (max rank)"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for world, gather, results in rows:
        share, largest = results[0]["share"], results[0]["largest"]
        cells = [str(world), "gathered (stage3_gather_16bit_weights_on_model_save)" if gather else "partitioned",
                 f"{share:.0f}", f"{largest:.1f}", f"{share + largest:.0f}",
                 f"{max(r['save'] for r in results):.0f}", f"{max(r['load'] for r in results):.0f}"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def bench_reshard(name, repeats, root):
    """Save once at mp 1; load it at mp 1, 2 and 4 in fresh processes. Returns rows for the table."""
    from megatron.spawn import run_distributed
    model, optimizer, scheduler = build(*SIZES[name])
    load_dir = os.path.join(root, f"reshard_{name}")
    with contextlib.redirect_stdout(io.StringIO()):
        save_checkpoint(TrainState(iteration=1), model, optimizer, scheduler, CheckpointOptions(save=load_dir))
    del model, optimizer, scheduler
    rows = []
    for world in (1, 2, 4):
        results = run_distributed(_reshard_worker, world, args=(name, load_dir, repeats), model_parallel_size=world,
                                  timeout=1800)
        rows.append((world, results))
    shutil.rmtree(load_dir)
    return rows


def print_reshard_table(name, rows):
    columns = ["state", "loaded at", "seconds/process", "vs plain", "anon RSS MB/process", "owned MB/process",
               "anon growth in load MB/process", "largest tensor MB"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    plain = rows[0][1][0]["seconds"]
    for world, results in rows:
        seconds = max(r["seconds"] for r in results)
        how = "mp1 (own loader)" if world == 1 else f"mp{world} (resharded)"
        cells = [name, how, f"{seconds:.2f}", f"{seconds / plain:.2f}x", f"{max(r['anon'] for r in results):.0f}",
                 f"{results[0]['share']:.0f}", f"{max(r['growth'] for r in results):.0f}",
                 f"{results[0]['largest']:.0f}"]
        print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,1gb", help=f"comma-separated from {sorted(SIZES)}")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)")
    parser.add_argument("--reshard", action="store_true",
                        help="also load each size at model-parallel 1, 2, 4 in fresh processes (resharding table)")
    parser.add_argument("--zero3-memory", action="store_true",
                        help="also the ZeRO-3 save/load peak host memory per rank at dp 2 and 4 (8 x 1024^2 model)")
    options = parser.parse_args()
    init_single_process()
    root = tempfile.mkdtemp(dir=options.dir)
    columns = ["state", "MB", "plain save", "plain save+fsync", "ours save", "ours/plain", "ours/plain+fsync",
               "plain load", "plain load+apply", "ours load", "ours/plain+apply"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    try:
        for name in options.sizes.split(","):
            with contextlib.redirect_stdout(io.StringIO()):  # the per-save/load notices
                size, rate = bench(name, options.repeats, root)
            cells = [name, f"{size / 1e6:.1f}", *(f"{rate[key]:.0f}" for key in
                                                  ("plain save", "plain save+fsync", "ours save")),
                     f"{rate['ours save'] / rate['plain save']:.2f}x",
                     f"{rate['ours save'] / rate['plain save+fsync']:.2f}x",
                     *(f"{rate[key]:.0f}" for key in ("plain load", "plain load+apply", "ours load")),
                     f"{rate['ours load'] / rate['plain load+apply']:.2f}x"]
            print("| " + " | ".join(cell.rjust(len(column)) for cell, column in zip(cells, columns)) + " |",
                  flush=True)
        print_manifest_table([(name, *bench_manifest(name, options.repeats, root))
                              for name in options.sizes.split(",")])
        print_async_table([(name, "fork" if fork else "thread", *bench_async(name, options.repeats, root, fork))
                           for name in options.sizes.split(",") for fork in (True, False)])
        if options.reshard:
            for name in options.sizes.split(","):
                print_reshard_table(name, bench_reshard(name, options.repeats, root))
        if options.zero3_memory:
            print_zero3_memory_table(bench_zero3_memory(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
