"""Write a webtext-style loose JSON corpus from the docstrings of the locked runtime packages' sources.

    python tools/make_sample_corpus.py --output data/webtext/webtext.json            # ~19 MB, ~20 s on 2 cores
    python tools/make_sample_corpus.py --output /tmp/small.json --max-mb 0.3 --stdlib-only

One JSON object per line, `{"text": ..., "url": "python://<package>/<file>"}` (the shape of OpenWebText's loose
JSON). Sources are read as text and parsed with `ast`: nothing is imported or executed. A document is the
docstrings of one module (module, classes, functions in source order, separated by blank lines), cut into
documents of at most --max-doc-chars at docstring boundaries. Files are listed in sorted order (SOURCE_PACKAGES by
name) and visited in a random.Random(--seed) shuffle of that list, so every part of it (Megatron's --split takes
contiguous document ranges) mixes all packages, as a shuffled web crawl does; it stops once --max-mb of text has
been written. The default corpus reads only packages whose versions requirements.lock fixes (not the standard
library, which follows the Python version, nor torch, which a GPU user brings): the same bytes on every machine that
installed the lock, whatever its Python or torch (tools/prepare_default_data.py checks the digest). --stdlib-only
(small corpora for tests) follows the Python version.
"""
import ast
import importlib.util
import json
import multiprocessing
import os
import random
import sys
import sysconfig
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron import cli  # noqa: E402
from megatron.checkpoint.atomic_io import atomic_path  # noqa: E402

DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


# The import names of runtime packages pinned in requirements.lock (the requirements and what they pull in), a fixed
# list, so installing the test extras (DeepSpeed, transformers, ...) does not change the default corpus, its
# tokenizer or the numbers printed from them. torch's dependencies are here (the lock pins them); torch is not.
SOURCE_PACKAGES = ("PIL", "click", "contourpy", "cycler", "dateutil", "filelock", "fontTools", "fsspec", "jinja2",
                   "joblib", "kiwisolver", "markupsafe", "matplotlib", "mpmath", "networkx", "nltk", "numpy",
                   "packaging", "pyparsing", "regex", "sympy", "tiktoken", "tokenizers", "tqdm", "yaml")


def package_dir(name):
    """The directory of an installed package, found without importing it (in a venv that sees the system's
    site-packages a locked package may live in either); None when it is not installed."""
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def python_files(stdlib_only=False):
    """Sorted .py files (tests aside): the standard library with stdlib_only, else each of SOURCE_PACKAGES found
    where this Python installs packages (a package that is missing is skipped: the digest check names it)."""
    if stdlib_only:
        roots = [("stdlib", sysconfig.get_paths()["stdlib"])]
    else:
        roots = [(name, package_dir(name)) for name in SOURCE_PACKAGES if package_dir(name)]
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib"))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    yield label, root, os.path.join(dirpath, name)


def module_documents(job):
    """Docstrings of one source file as a list of (url, text) documents; [] if unreadable or docstring-free."""
    label, root, path, max_doc_chars, min_doc_chars = job
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
        return []
    docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, DOC_NODES)]
    docstrings = [d.strip() for d in docstrings if d and d.strip()]
    url = f"python://{label}/{os.path.relpath(path, root)}"
    documents, current = [], []
    for docstring in docstrings:
        if current and sum(map(len, current)) + len(docstring) > max_doc_chars:
            documents.append("\n\n".join(current))
            current = []
        current.append(docstring[:max_doc_chars])
    if current:
        documents.append("\n\n".join(current))
    return [(f"{url}#{i}" if len(documents) > 1 else url, text)
            for i, text in enumerate(documents) if len(text) >= min_doc_chars]


def write_corpus(output, max_mb=24.0, stdlib_only=False, workers=2, max_doc_chars=8000, min_doc_chars=200,
                 seed=1234):
    """Write the corpus to `output` (atomically); returns (documents, bytes)."""
    max_bytes = int(max_mb * 1e6)
    files = list(python_files(stdlib_only))
    random.Random(seed).shuffle(files)   # a module's documents stay together; modules of all packages interleave
    jobs = ((label, root, path, max_doc_chars, min_doc_chars) for label, root, path in files)
    docs = written = 0
    ctx = multiprocessing.get_context("fork")
    with atomic_path(output) as tmp:
        with open(tmp, "w", encoding="utf-8") as out, ctx.Pool(max(1, workers)) as pool:
            for documents in pool.imap(module_documents, jobs, chunksize=8):
                for url, text in documents:
                    line = json.dumps({"text": text, "url": url}, ensure_ascii=False) + "\n"
                    out.write(line)
                    docs += 1
                    written += len(line.encode("utf-8"))
                if written >= max_bytes:
                    break
    return docs, written


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSON lines file to write")
    parser.add_argument("--max-mb", type=float, default=24.0, help="stop after this many MB (default 24)")
    parser.add_argument("--stdlib-only", action="store_true", help="only the standard library (~2 MB)")
    parser.add_argument("--workers", type=int, default=2, help="parser processes (default 2)")
    parser.add_argument("--seed", type=int, default=1234, help="the order files are visited in (default 1234)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    start = time.time()
    docs, written = write_corpus(args.output, args.max_mb, args.stdlib_only, args.workers, seed=args.seed)
    print(f"wrote {docs} documents, {written / 1e6:.1f} MB to {args.output} in {time.time() - start:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
