"""Build the embedded default dataset once: corpus -> tokenizer -> preprocessed data, under data/webtext/.

    python tools/prepare_default_data.py            # ~20 s on 2 cores; prints the paths to pass to training

Steps (each skipped when its outputs exist, so rerunning is instant; delete data/webtext/ to rebuild):
  1. data/webtext/webtext.json        tools/make_sample_corpus.py (~19 MB of Python docstrings)
  2. data/webtext/{vocab,merges}      tools/train_tokenizer.py (byte-level BPE, vocab 8192)
  3. data/webtext/webtext_text_document.{bin,idx}   tools/preprocess_data.py --append-eod
Then it prints the digest of the five files and checks it against DEFAULT_DATA_DIGEST (the one README.md states):
a mismatch is one warning line naming the digest and the installed packages whose versions differ from
requirements.lock (`make install` installs the lock; then `make clean-data data`).
Then train with:
  --data-path data/webtext/webtext_text_document --vocab-file data/webtext/vocab.json
  --merge-file data/webtext/merges.txt        (or --train-data webtext)
"""
import hashlib
import importlib.metadata
import os
import re
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


# The digest of the default data built from requirements.lock's packages (README.md states it; `make lock` changes it)
DEFAULT_DATA_DIGEST = "845b8bad124aace2"
DATA_FILES = ("webtext.json", "vocab.json", "merges.txt", "webtext_text_document.bin", "webtext_text_document.idx")
LOCK_FILE = os.path.join(REPO_ROOT, "requirements.lock")


def data_digest(out_dir):
    """SHA-256 (first 16 hex digits) over the names and SHA-256s of the corpus, tokenizer and .bin/.idx files."""
    whole = hashlib.sha256()
    for name in DATA_FILES:
        with open(os.path.join(out_dir, name), "rb") as f:
            whole.update(f"{name} {hashlib.file_digest(f, 'sha256').hexdigest()}\n".encode())
    return whole.hexdigest()[:16]


def locked_versions(lock_file=LOCK_FILE):
    """{distribution name (normalised): version} of the `name==version` lines of a lock file."""
    pins = {}
    with open(lock_file) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                pins[normalise(name)] = version.strip()
    return pins


def normalise(name):
    """PEP 503's normalised distribution name: each run of '-', '_' and '.' is one '-', lower case
    ('Zope_Interface', 'zope.interface' -> 'zope-interface')."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def version_differences(pins):
    """'name installed (lock locked)' for each locked package installed at another version or missing."""
    differ = []
    for name, locked in sorted(pins.items()):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "missing"
        if installed != locked:
            differ.append(f"{name} {installed} (lock {locked})")
    return differ


def check_digest(digest, expected=DEFAULT_DATA_DIGEST, lock_file=LOCK_FILE):
    """None when the digest is the expected one, else the one-line warning naming what differs."""
    if digest == expected:
        return None
    differ = version_differences(locked_versions(lock_file))
    why = ("package versions differ from requirements.lock: " + ", ".join(differ) + " (make install installs the "
           "lock; then make clean-data data)") if differ else "the installed versions equal requirements.lock"
    return f"warning: default data digest {digest} is not README.md's {expected}: {why}"


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
    digest = data_digest(args.output_dir)
    print(f"default data digest: {digest}", flush=True)
    defaults = (parser.get_default("corpus_mb"), parser.get_default("vocab_size"))   # the README's data only
    if (args.corpus_mb, args.vocab_size) == defaults and (warning := check_digest(digest)):
        print(warning, file=sys.stderr, flush=True)
    print(f"default data ready in {time.time() - start:.1f} s:\n"
          f"  --data-path {rel['data_prefix']} --vocab-file {rel['vocab_file']} --merge-file {rel['merge_file']}")


if __name__ == "__main__":
    main()
