"""Benchmark tools/preprocess_data.py (1 and 2 workers x both tokenizer backends) and the GPT sample index.

    python tools/prepare_default_data.py && python tools/bench/bench_preprocess.py     # ~2 min on 2 cores

Prints a markdown table of end-to-end MB/s and docs/s (wall time of the whole preprocess: reading, JSON, BPE,
writing; tokenizer loading included) on the sample corpus with the default 8192 vocab (both backends) and with a
GPT-2-sized 50257 vocab trained on the same corpus (tiktoken; GPT-2's own files cannot be downloaded here), then the
time to build the doc/sample/shuffle indices for a synthetic 100M-token dataset. Run it on a quiet machine; it is
not a test.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)
sys.path.insert(0, REPO_ROOT)

import preprocess_data  # noqa: E402
from megatron.data.gpt_dataset import build_index_arrays  # noqa: E402


def bench_preprocess(corpus, vocab, merges, workers, backend, out_dir):
    args = preprocess_data.get_args([
        "--input", corpus, "--output-prefix", os.path.join(out_dir, f"bench_{backend}_{workers}"),
        "--vocab-file", vocab, "--merge-file", merges, "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
        "--workers", str(workers), "--tokenizer-backend", backend, "--log-interval", "100000000"])
    start = time.perf_counter()
    stats = preprocess_data.preprocess(args)
    seconds = time.perf_counter() - start
    return stats, seconds


def bench_sample_index(total_tokens=100_000_000, seq_length=1024, mean_doc=1000, seed=1234):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2 * mean_doc, size=total_tokens // mean_doc, dtype=np.int32)
    sizes[-1] += total_tokens - int(sizes.sum())
    documents = np.arange(len(sizes), dtype=np.int32)
    num_samples = (total_tokens - 1) // seq_length
    start = time.perf_counter()
    doc_idx, sample_idx, shuffle_idx = build_index_arrays(sizes, documents, num_samples, seq_length, seed)
    return time.perf_counter() - start, len(sizes), len(shuffle_idx)


def main(argv=None):
    data = os.path.join(REPO_ROOT, "data", "webtext")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=os.path.join(data, "webtext.json"))
    parser.add_argument("--vocab-file", default=os.path.join(data, "vocab.json"))
    parser.add_argument("--merge-file", default=os.path.join(data, "merges.txt"))
    parser.add_argument("--backends", nargs="+", default=["tiktoken", "reference"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--no-gpt2-size-vocab", dest="gpt2_size_vocab", action="store_false",
                        help="skip the run with a 50257 vocab trained on the corpus")
    args = parser.parse_args(argv)
    for path in (args.input, args.vocab_file, args.merge_file):
        if not os.path.exists(path):
            raise SystemExit(f"{path} not found: run python tools/prepare_default_data.py first")
    size_mb = os.path.getsize(args.input) / 1e6
    print(f"corpus {args.input}: {size_mb:.1f} MB; vocab {args.vocab_file}; {os.cpu_count()} CPUs\n")
    out_dir = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        runs = [(args.vocab_file, args.merge_file, backend) for backend in args.backends]
        if args.gpt2_size_vocab:
            import train_tokenizer
            vocab_dir = os.path.join(out_dir, "vocab50257")
            vocab_50k, merges_50k, _ = train_tokenizer.train([args.input], vocab_dir, vocab_size=50257)
            runs.append((vocab_50k, merges_50k, "tiktoken"))
        print("| vocab | backend | workers | docs | tokens | seconds | MB/s | docs/s |")
        print("|---|---|---|---|---|---|---|---|")
        for vocab, merges, backend in runs:
            vocab_size = len(json.load(open(vocab, encoding="utf-8")))
            for workers in args.workers:
                stats, seconds = bench_preprocess(args.input, vocab, merges, workers, backend, out_dir)
                print(f"| {vocab_size} | {backend} | {workers} | {stats['documents']} | {stats['tokens']} | "
                      f"{seconds:.2f} | {size_mb / seconds:.2f} | {stats['documents'] / seconds:.0f} |", flush=True)
    finally:
        shutil.rmtree(out_dir)
    for seq_length in (1024, 128):
        seconds, docs, samples = bench_sample_index(seq_length=seq_length)
        print(f"\nsample index, synthetic 100M tokens ({docs} documents, seq_length {seq_length}, {samples} samples):"
              f" {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
