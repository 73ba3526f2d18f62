"""Named corpora: `--train-data webtext` -> the preprocessed prefix under data/.

    prefix = resolve_corpus("webtext")   # 'data/webtext/webtext_text_document' (checked to exist)

The path is relative to the repository root (so it works from any working directory). A missing corpus raises
FileNotFoundError whose message is the exact command that builds it.
"""
import os

from megatron.cli import UserError

from .indexed_dataset import data_file_path, dataset_exists, index_file_path

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

CORPORA = {
    # name: (prefix relative to the repository root, how to build it)
    "webtext": ("data/webtext/webtext_text_document",
                "python tools/prepare_default_data.py    # embedded default: docstring corpus + trained 8192 BPE\n"
                "  or, with real OpenWebText (see data/README.md):\n"
                "python tools/preprocess_data.py --input data/webtext/webtext.json "
                "--output-prefix data/webtext/webtext --vocab-file data/webtext/vocab.json "
                "--merge-file data/webtext/merges.txt --tokenizer-type GPT2BPETokenizer --dataset-impl mmap "
                "--append-eod --workers 2"),
}


class DataPathError(UserError, FileNotFoundError):
    """A named corpus or --data-path prefix whose .bin/.idx files are missing; the message says how to build them."""


def corpus_names():
    return sorted(CORPORA)


def resolve_corpus(name, root=REPO_ROOT):
    """Absolute data prefix of the named corpus; DataPathError with the build command if it is missing."""
    if name not in CORPORA:
        raise ValueError(f"unknown --train-data {name!r}; known corpora: {', '.join(corpus_names())} "
                         "(or pass --data-path PREFIX)")
    relative, command = CORPORA[name]
    prefix = os.path.join(root, relative)
    if not dataset_exists(prefix):
        missing = [p for p in (index_file_path(prefix), data_file_path(prefix)) if not os.path.exists(p)]
        raise DataPathError(f"--train-data {name}: missing {', '.join(missing)}. Build it from the "
                                f"repository root with:\n  {command}")
    return prefix


def resolve_data_path(data_path=None, train_data=None, root=REPO_ROOT):
    """The data prefix list for build_train_valid_test_datasets from --data-path (a prefix or a 'w1 p1 w2 p2'
    blend, as a list or a string) or --train-data NAME. Checks that every prefix exists."""
    if data_path and train_data:
        raise ValueError(f"pass either --data-path or --train-data, not both (got {data_path} and {train_data})")
    if train_data:
        return [resolve_corpus(train_data, root)]
    if not data_path:
        raise ValueError("no training data: pass --data-path PREFIX or --train-data NAME")
    prefixes = [data_path] if isinstance(data_path, str) else list(data_path)
    if len(prefixes) == 1 and " " in prefixes[0].strip():
        prefixes = prefixes[0].split()
    for prefix in (prefixes if len(prefixes) == 1 else prefixes[1::2]):
        if not dataset_exists(prefix):
            missing = [p for p in (index_file_path(prefix), data_file_path(prefix)) if not os.path.exists(p)]
            raise DataPathError(f"--data-path {prefix}: missing {', '.join(missing)} (run "
                                    "tools/preprocess_data.py; it writes PREFIX_text_document.{bin,idx}, and "
                                    "--data-path takes PREFIX_text_document)")
    return prefixes
