"""Benchmark the raw-shard stream (megatron/data/stream) against the indexed path (.bin/.idx).

    python tools/prepare_default_data.py && python tools/bench/bench_stream.py        # ~7 min on 2 quiet cores

Prints markdown tables:
1. Loader throughput: the default corpus (data/webtext/webtext.json, its vocabulary) written as 8 Parquet and as
   8 JSONL.gz shards, read through StreamLoader (seq 1024, micro batch 8, stream order) with 0 (in-process), 1 and 2
   tokenizer workers, beside GPTDataset over the preprocessed .bin/.idx: new tokens per second (and per worker), and
   the workers that would keep up with --target tokens/s (580k: one H200 at the GPT-2 124M goal).
2. Start and memory: time to the first batch on a synthetic shard set of --synthetic-mb (JSONL, 16 shards) and on
   4x as many shards (the same files linked 4 times), and the loader's peak resident memory (0 workers: all in one
   process) after the first --memory-batches batches of each. Each measurement runs in a fresh process.
3. Data wait in the `make pretrain` recipe (scripts/ds_pretrain_gpt.sh as it is, --recipe-iters iterations, the
   device's recipe: the CPU's small model or GPT-2 124M on a GPU), reading the preprocessed .bin/.idx and streaming
   the default corpus written as 8 JSONL shards (0 and 1 tokenizer workers): ms per iteration and the
   `batch-generator` timer (--timing-log-level 1; reading the micro batches), both from the run's --log-jsonl,
   averaged over the log intervals after the first (which holds the start-up), and its share of the step.
It is not a test: run it on a quiet machine. `--tables recipe` runs the third alone.
"""
import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WEBTEXT = os.path.join(REPO_ROOT, "data", "webtext")
SEQ, MICRO = 1024, 8


def write_shards(texts, directory, kind, shards):
    """`texts` split into `shards` consecutive files of `kind` (parquet, jsonl.gz, jsonl)."""
    os.makedirs(directory, exist_ok=True)
    per = math.ceil(len(texts) / shards)
    for i in range(shards):
        part, path = texts[i * per:(i + 1) * per], os.path.join(directory, f"part-{i:05d}.{kind}")
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"text": part}), path)
        else:
            data = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
            with (gzip.open(path, "wb", compresslevel=6) if kind.endswith(".gz") else open(path, "wb")) as f:
                f.write(data)
    return directory


def measure(spec):
    """One measurement in this process: {'first_batch_s', 'tokens_per_s', 'peak_rss_mb'}."""
    from bench_common import peak_rss_mb
    from megatron.data.stream import StreamConfig, StreamLoader, list_shards
    start = time.perf_counter()
    if spec["kind"] == "indexed":
        from megatron.data.gpt_dataset import build_train_valid_test_datasets
        from megatron.data.samplers import pretraining_loader
        dataset = build_train_valid_test_datasets([os.path.join(WEBTEXT, "webtext_text_document")], "100,0,0",
                                                  [spec["batches"] * MICRO, 0, 0], SEQ, 1234,
                                                  data_cache_path=spec["cache"])[0]
        loader = iter(pretraining_loader(dataset, 0, MICRO, 0, 1, spec["workers"]))
    else:
        config = StreamConfig(tuple(list_shards(spec["path"])), "text", os.path.join(WEBTEXT, "vocab.json"),
                              os.path.join(WEBTEXT, "merges.txt"), True, 1234, spec.get("shuffle", False))
        loader = StreamLoader(config, SEQ, 0, MICRO, 0, 1, num_workers=spec["workers"])
    next(loader)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(spec["batches"]):
        next(loader)
    seconds = time.perf_counter() - start
    return {"first_batch_s": first, "tokens_per_s": spec["batches"] * MICRO * SEQ / seconds,
            "peak_rss_mb": peak_rss_mb()}


def run_child(spec):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput_table(work, args, texts):
    rows = ["| source | workers | tokens/s | tokens/s per worker | workers for %s tokens/s |" % f"{args.target:,}",
            "|---|---|---|---|---|"]
    indexed = run_child({"kind": "indexed", "workers": 0, "batches": args.batches, "cache": work})
    rows.append(f"| .bin/.idx (GPTDataset) | 0 | {indexed['tokens_per_s']:,.0f} | | |")
    for kind in ("parquet", "jsonl.gz"):
        path = write_shards(texts, os.path.join(work, kind), kind, 8)
        for workers in args.workers:
            r = run_child({"kind": kind, "path": path, "workers": workers, "batches": args.batches})
            per_worker = r["tokens_per_s"] / max(workers, 1)
            rows.append(f"| {kind} | {workers} | {r['tokens_per_s']:,.0f} | {per_worker:,.0f} | "
                        f"{math.ceil(args.target / per_worker)} |")
    return rows


def start_and_memory_table(work, args, texts):
    one = os.path.join(work, "synthetic_1x")
    line_bytes = sum(len(t) for t in texts) + 12 * len(texts)
    copies = max(1, round(args.synthetic_mb * 2 ** 20 / line_bytes))
    write_shards(texts * copies, one, "jsonl", 16)
    four = os.path.join(work, "synthetic_4x")
    os.makedirs(four)
    for copy in range(4):
        for name in os.listdir(one):
            os.symlink(os.path.join(one, name), os.path.join(four, f"{copy}-{name}"))
    size_mb = sum(os.path.getsize(os.path.join(one, n)) for n in os.listdir(one)) / 2 ** 20
    rows = ["| shard set | shards | MB | first batch (s) | peak RSS after %d batches (MB) |" % args.memory_batches,
            "|---|---|---|---|---|"]
    for label, path, count, mb in (("1x", one, 16, size_mb), ("4x", four, 64, 4 * size_mb)):
        r = run_child({"kind": "jsonl", "path": path, "workers": 0, "batches": args.memory_batches, "shuffle": True})
        rows.append(f"| {label} | {count} | {mb:,.0f} | {r['first_batch_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    return rows


def recipe_run(data_path, workers, work, iters):
    """scripts/ds_pretrain_gpt.sh on `data_path` with `workers` loader workers: the --log-jsonl training records."""
    name = f"{os.path.basename(data_path)}-{workers}"
    log = os.path.join(work, f"{name}.jsonl")
    env = dict(os.environ, PYTHON=sys.executable, DATA_PATH=data_path, TRAIN_ITERS=str(iters), LOG_JSONL=log,
               CHECKPOINT_PATH=os.path.join(work, f"ckpt-{name}"),
               EXTRA_ARGS=f"--timing-log-level 1 --num-workers {workers}")
    subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "ds_pretrain_gpt.sh")], cwd=REPO_ROOT, env=env,
                   check=True, capture_output=True, text=True)
    with open(log) as handle:
        return [r for r in map(json.loads, handle) if r.get("type") == "train"]


def recipe_table(work, args, texts):
    shards = write_shards(texts, os.path.join(work, "recipe_jsonl"), "jsonl", 8)
    rows = ["| data | workers | ms per iteration | data wait ms per iteration | data wait / step | "
            "first interval: data wait ms per iteration |", "|---|---|---|---|---|---|"]
    for label, path, workers in ((".bin/.idx", os.path.join(WEBTEXT, "webtext_text_document"), 0),
                                 ("JSONL shards (streamed)", shards, 0), ("JSONL shards (streamed)", shards, 1)):
        first, *steady = recipe_run(path, workers, work, args.recipe_iters)
        if not steady:
            raise SystemExit("--recipe-iters: give at least two log intervals (20 iterations)")
        step = sum(r["ms_per_iteration"] for r in steady) / len(steady)
        wait = sum(r["timers_ms"]["batch-generator"] for r in steady) / len(steady)
        rows.append(f"| {label} | {workers} | {step:,.1f} | {wait:.2f} | {100 * wait / step:.2f}% | "
                    f"{first['timers_ms']['batch-generator']:.2f} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=300, help="batches timed per throughput row")
    parser.add_argument("--synthetic-mb", type=float, default=1024)
    parser.add_argument("--memory-batches", type=int, default=20)
    parser.add_argument("--target", type=int, default=580_000)
    parser.add_argument("--recipe-iters", type=int, default=60, help="iterations of each make-pretrain run")
    parser.add_argument("--tables", nargs="+", choices=["throughput", "start", "recipe"],
                        default=["throughput", "start", "recipe"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return
    with open(os.path.join(WEBTEXT, "webtext.json")) as f:
        texts = [json.loads(line)["text"] for line in f]
    print(f"# {os.cpu_count()} CPUs; the default corpus: {len(texts)} documents; loader tables: seq {SEQ}, micro "
          f"batch {MICRO}")
    tables = {"throughput": throughput_table, "start": start_and_memory_table, "recipe": recipe_table}
    with tempfile.TemporaryDirectory() as work:
        for name in args.tables:
            print("\n" + "\n".join(tables[name](work, args, texts)), flush=True)


if __name__ == "__main__":
    main()
