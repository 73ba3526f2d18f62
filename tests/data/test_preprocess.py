"""tools/preprocess_data.py: output equals the tokenizer's ids, independent of --workers and backend; bad input
is an error naming the line, with nothing left under the final names."""
import json
import os
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import GPT2BPETokenizer
from tests.helpers import REPO, build_small_corpus, write_jsonl  # also puts tools/ on sys.path
from tests import warm_python

import make_sample_corpus  # noqa: E402  (tools/)
import preprocess_data  # noqa: E402  (tools/)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("pre")))


def _run(small, prefix, *extra, corpus=None):
    args = preprocess_data.get_args([
        "--input", corpus or small["corpus"], "--output-prefix", prefix, "--vocab-file", small["vocab"],
        "--merge-file", small["merges"], "--tokenizer-type", "GPT2BPETokenizer", *extra])
    return preprocess_data.preprocess(args)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_documents_equal_tokenizer_ids(small, tmp_path):
    prefix = str(tmp_path / "out")
    stats = _run(small, prefix, "--append-eod", "--workers", "1")
    tok = GPT2BPETokenizer(small["vocab"], small["merges"])
    expected = [tok.tokenize(t) + [tok.eod] for t in small["texts"] if tok.tokenize(t)]
    assert len(expected) == len(small["texts"]) - 1  # the empty document is skipped; "   " is a token
    ds = MMapIndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.uint16
    assert ds.doc_idx.tolist() == list(range(len(expected) + 1))
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert stats["documents"] == len(small["texts"]) and stats["tokens"] == sum(map(len, expected))
    assert sorted(os.listdir(tmp_path)) == ["out_text_document.bin", "out_text_document.idx"]


def test_workers_and_backends_give_identical_files(small, tmp_path):
    outputs = []
    for workers, backend in (("1", "tiktoken"), ("2", "tiktoken"), ("2", "reference")):
        prefix = str(tmp_path / f"w{workers}{backend}")
        # tiny blocks so that several blocks are in flight across the 2 workers
        preprocess_data.BLOCK_BYTES, saved = 4096, preprocess_data.BLOCK_BYTES
        try:
            _run(small, prefix, "--append-eod", "--workers", workers, "--tokenizer-backend", backend)
        finally:
            preprocess_data.BLOCK_BYTES = saved
        outputs.append((_read(prefix + "_text_document.bin"), _read(prefix + "_text_document.idx")))
    assert outputs[0] == outputs[1] == outputs[2]


def test_read_blocks_keeps_every_line(tmp_path):
    path = tmp_path / "x.json"
    lines = [json.dumps({"text": "é" * n}) for n in range(300)]
    path.write_text("\n".join(lines), encoding="utf-8")  # no final newline
    blocks = list(preprocess_data.read_blocks(str(path), block_bytes=100))
    joined = b"".join(block for _, block, _ in blocks).decode("utf-8").split("\n")
    assert joined == lines
    assert blocks[-1][2] == os.path.getsize(path)
    first_lines = [first for first, _, _ in blocks]
    counts = [block.count(b"\n") for _, block, _ in blocks]
    assert first_lines == [1 + sum(counts[:i]) for i in range(len(blocks))]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_line_is_named_and_no_output_is_left(small, tmp_path, workers):
    corpus = write_jsonl(str(tmp_path / "bad.json"), ["one", "two", "three"])
    with open(corpus, "a") as f:
        f.write('{"text": "four"}\n{"text": broken\n{"txt": "six"}\n')
    out_dir = tmp_path / "out"
    with pytest.raises(preprocess_data.BadInput, match=r"bad.json:5: malformed JSON"):
        _run(small, str(out_dir / "x"), "--workers", workers, corpus=corpus)
    assert os.listdir(out_dir) == []
    stats = _run(small, str(out_dir / "x"), "--skip-bad-lines", "--workers", workers, corpus=corpus)
    assert stats["bad_lines"] == 2 and stats["documents"] == 4
    assert len(MMapIndexedDataset(str(out_dir / "x_text_document"))) == 4


def test_missing_key_and_wrong_type(small, tmp_path):
    corpus = str(tmp_path / "k.json")
    with open(corpus, "w") as f:
        f.write('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(preprocess_data.BadInput, match=r"k.json:2: missing key 'text'"):
        _run(small, str(tmp_path / "x"), corpus=corpus)
    with open(corpus, "w") as f:
        f.write('{"text": 3}\n')
    with pytest.raises(preprocess_data.BadInput, match=r"k.json:1: key 'text' is int"):
        _run(small, str(tmp_path / "x"), corpus=corpus)


def test_split_sentences_uses_pretrained_english_punkt(small, tmp_path):
    import punkt
    texts = ["Dr. Smith went home. He was tired. Mr. Jones stayed at the U.S. embassy until 5 p.m. today.",
             "One sentence only", "", "Line one.\nLine two. And three."]
    corpus = write_jsonl(str(tmp_path / "s.json"), texts)
    prefix = str(tmp_path / "s")
    _run(small, prefix, "--split-sentences", "--append-eod", corpus=corpus)
    tok = GPT2BPETokenizer(small["vocab"], small["merges"])
    ds = MMapIndexedDataset(prefix + "_text_sentence")
    expected_docs = []
    for text in texts:
        sentences = [tok.tokenize(s) for s in punkt.sent_tokenize(text)]  # an independent Punkt implementation
        if sentences:
            sentences[-1] = sentences[-1] + [tok.eod]
            expected_docs.append(sentences)
    assert [len(d) for d in expected_docs] == [3, 1, 3]   # "Dr." "U.S." "p.m." are not sentence ends
    got = [[ds[i].tolist() for i in range(ds.doc_idx[k], ds.doc_idx[k + 1])] for k in range(len(ds.doc_idx) - 1)]
    assert got == expected_docs


def test_keep_newlines_keeps_them_in_sentences(small, tmp_path):
    splitter = preprocess_data.english_sentence_splitter(keep_newlines=True)
    assert splitter.tokenize("Line one.\nLine two.") == ["Line one.\n", "Line two."]
    assert preprocess_data.english_sentence_splitter().tokenize("Line one.\nLine two.") == ["Line one.",
                                                                                             "Line two."]


def test_cli_end_to_end(small, tmp_path):
    prefix = str(tmp_path / "cli")
    result = warm_python.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", small["corpus"],
         "--output-prefix", prefix, "--vocab-file", small["vocab"], "--merge-file", small["merges"],
         "--tokenizer-type", "GPT2BPETokenizer", "--dataset-impl", "mmap", "--append-eod", "--workers", "2",
         "--log-interval", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "docs/s" in result.stderr and "MB/s" in result.stderr
    assert len(MMapIndexedDataset(prefix + "_text_document")) == len(small["texts"]) - 1
    bad = warm_python.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", small["corpus"],
         "--output-prefix", prefix, "--vocab-file", small["merges"], "--merge-file", small["merges"],
         "--tokenizer-type", "GPT2BPETokenizer"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "merges.txt: not a JSON vocab file" in bad.stderr


def test_sample_corpus_is_deterministic(tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    docs_a, size_a = make_sample_corpus.write_corpus(a, max_mb=0.2, stdlib_only=True, workers=2)
    docs_b, size_b = make_sample_corpus.write_corpus(b, max_mb=0.2, stdlib_only=True, workers=1)
    assert _read(a) == _read(b) and docs_a == docs_b > 10 and size_a >= 200_000
    first = json.loads(open(a, encoding="utf-8").readline())
    assert first["url"].startswith("python://stdlib/") and len(first["text"]) >= 200
    # files are visited in a seeded shuffle, so a contiguous split mixes modules from all over the sorted listing
    urls = [json.loads(line)["url"] for line in open(a, encoding="utf-8")]
    assert urls != sorted(urls), urls
    c = str(tmp_path / "c.json")
    make_sample_corpus.write_corpus(c, max_mb=0.2, stdlib_only=True, workers=1, seed=1)
    assert _read(c) != _read(a)
