"""Build the embedded default dataset once: corpus -> tokenizer -> preprocessed data, under data/webtext/.

    python tools/prepare_default_data.py            # ~20 s on 2 cores; prints the paths to pass to training

Steps (each skipped when its outputs exist, so rerunning is instant; delete data/webtext/ to rebuild):
  1. data/webtext/webtext.json        tools/make_sample_corpus.py (~19 MB of Python docstrings)
  2. data/webtext/{vocab,merges}      tools/train_tokenizer.py (byte-level BPE, vocab 8192)
  3. data/webtext/webtext_text_document.{bin,idx}   tools/preprocess_data.py --append-eod
Then train with:
  --data-path data/webtext/webtext_text_document --vocab-file data/webtext/vocab.json
  --merge-file data/webtext/merges.txt        (or --train-data webtext)
"""
import os
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)
sys.path.insert(0, REPO_ROOT)
from megatron import cli  # noqa: E402
import make_sample_corpus  # noqa: E402
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


def prepare(out_dir, corpus_mb=24.0, vocab_size=8192, workers=2):
    """Returns {'corpus', 'vocab_file', 'merge_file', 'data_prefix'} (paths), building what is missing."""
    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, "webtext.json")
    vocab, merges = os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")
    prefix = os.path.join(out_dir, "webtext")
    data_prefix = prefix + "_text_document"
    if not os.path.exists(corpus):
        start = time.time()
        docs, written = make_sample_corpus.write_corpus(corpus, max_mb=corpus_mb, workers=workers)
        print(f"[1/3] corpus: {docs} documents, {written / 1e6:.1f} MB in {time.time() - start:.1f} s", flush=True)
    else:
        print(f"[1/3] corpus: exists, {corpus}", flush=True)
    if not (os.path.exists(vocab) and os.path.exists(merges)):
        start = time.time()
        train_tokenizer.train([corpus], out_dir, vocab_size=vocab_size)
        print(f"[2/3] tokenizer: vocab {vocab_size} in {time.time() - start:.1f} s", flush=True)
    else:
        print(f"[2/3] tokenizer: exists, {vocab}", flush=True)
    if not (os.path.exists(data_prefix + ".bin") and os.path.exists(data_prefix + ".idx")):
        args = preprocess_data.get_args([
            "--input", corpus, "--output-prefix", prefix, "--vocab-file", vocab, "--merge-file", merges,
            "--tokenizer-type", "GPT2BPETokenizer", "--dataset-impl", "mmap", "--append-eod",
            "--workers", str(workers), "--log-interval", "1000000"])
        stats = preprocess_data.preprocess(args)
        print(f"[3/3] preprocess: {stats['documents']} documents, {stats['tokens']} tokens in "
              f"{stats['seconds']:.1f} s", flush=True)
    else:
        print(f"[3/3] preprocess: exists, {data_prefix}.{{bin,idx}}", flush=True)
    return {"corpus": corpus, "vocab_file": vocab, "merge_file": merges, "data_prefix": data_prefix}


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "data", "webtext"))
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.time()
    paths = prepare(args.output_dir, args.corpus_mb, args.vocab_size, args.workers)
    rel = {k: os.path.relpath(v, os.getcwd()) for k, v in paths.items()}
    print(f"default data ready in {time.time() - start:.1f} s:\n"
          f"  --data-path {rel['data_prefix']} --vocab-file {rel['vocab_file']} --merge-file {rel['merge_file']}")


if __name__ == "__main__":
    main()
