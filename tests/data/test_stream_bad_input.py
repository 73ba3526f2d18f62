"""Bad raw shards (issue 69 item 4): a malformed JSON line, a row without the key, a truncated Parquet or gzip file,
an empty shard, a path or glob that names no shard: one line naming the file and the row, or, with
--skip-bad-records, skipped and counted (the count is in the stream's record, so a resumed run goes on counting)."""
import gzip
import json
import os
import sys

import numpy as np
import pytest

from megatron.data.stream import StreamConfig, StreamDataError, StreamLoader, list_shards
from tests.data.test_stream import documents, SEQ, tokenized, vocab  # noqa: F401  (vocab: a fixture)
from tests.helpers import REPO, TINY_SHAPE
from tests import warm_python


def _jsonl(path, lines):
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return path


def _parquet(path, texts, truncate=False):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": texts}), path, row_group_size=2)
    if truncate:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return path


def _loader(paths, vocab, skip=False, micro=1):
    config = StreamConfig(tuple(paths), "text", vocab["vocab"], vocab["merges"], True, 5, False)
    return StreamLoader(config, SEQ, 0, micro, 0, 1, skip_bad_records=skip)


def _truncated_gzip(path, texts):
    with gzip.open(path, "wb") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 12)
    return path


GOOD = json.dumps({"text": "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"})
CASES = {
    "malformed": (lambda d: _jsonl(f"{d}/a.jsonl", [GOOD, '{"text": "no end', GOOD]), r"a.jsonl: line 2: malformed JSON"),
    "missing key": (lambda d: _jsonl(f"{d}/a.jsonl", [GOOD, GOOD, "", json.dumps({"body": "x"})]),
                    r"a.jsonl: line 4: missing key 'text'"),
    "not a string": (lambda d: _jsonl(f"{d}/a.json", [json.dumps({"text": 3})]), r"a.json: line 1: key 'text' is int"),
    "parquet null": (lambda d: _parquet(f"{d}/a.parquet", ["x y z", "a b", None]), r"a.parquet: row 2: missing key"),
    "truncated parquet": (lambda d: _parquet(f"{d}/a.parquet", ["x y z"] * 50, truncate=True),
                          r"a.parquet: row 0: unreadable Parquet file"),
    "truncated gzip": (lambda d: _truncated_gzip(f"{d}/a.jsonl.gz", ["x y z"] * 50), r"a.jsonl.gz: line \d+: unreadable"),
    "empty shard": (lambda d: _jsonl(f"{d}/a.jsonl", []), r"a.jsonl: row 0: empty shard"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_record_is_one_line_naming_file_and_row(case, vocab, tmp_path):
    """The bad shard is followed by a good one: the error must come from the bad one, not from running dry."""
    make, message = CASES[case]
    path = make(str(tmp_path))
    loader = _loader([path, _jsonl(f"{tmp_path}/z.jsonl", [GOOD] * 5)], vocab)
    with pytest.raises(StreamDataError, match=f"^{tmp_path}/{message}") as error:
        for _ in range(30):
            next(loader)
    assert "\n" not in str(error.value) and "--skip-bad-records" in str(error.value)


@pytest.mark.parametrize("path,message", [("none/*.jsonl", "matches no .jsonl"), ("missing_dir/x.parquet",
                                                                                "no such file or directory")])
def test_paths_naming_no_shard_are_one_line(tmp_path, path, message):
    with pytest.raises(StreamDataError, match=message):
        list_shards(str(tmp_path / path))


def test_skip_bad_records_skips_counts_and_resumes_counting(vocab, tmp_path):
    """Every bad kind in one corpus: with --skip-bad-records the samples are the windows of the good documents
    alone, the count is 5, and a loader resumed from a record taken mid-way ends with the same count and samples."""
    good = documents(6, 9)
    paths = [_jsonl(f"{tmp_path}/a.jsonl", [json.dumps({"text": good[0]}), "{oops", json.dumps({"text": good[1]}),
                                            json.dumps({"other": 1}), json.dumps({"text": good[2]})]),
             _parquet(f"{tmp_path}/b.parquet", ["lost"] * 9, truncate=True),
             _jsonl(f"{tmp_path}/c.jsonl", []),
             _parquet(f"{tmp_path}/d.parquet", [good[3], None, good[4], good[5]])]
    tokens = np.array([t for doc in tokenized(good, vocab) for t in doc])
    count = (len(tokens) - 1) // SEQ
    expected = np.stack([tokens[k * SEQ:k * SEQ + SEQ + 1] for k in range(count)])
    whole = _loader(paths, vocab, skip=True, micro=count)
    np.testing.assert_array_equal(next(whole)["text"].numpy(), expected)
    assert whole.bad_records == 5
    first = _loader(paths, vocab, skip=True)
    while first.bad_records < 2:             # the malformed line and the missing key: a.jsonl's rows 1 and 3
        next(first)
    record = first.state_dict()
    assert record["bad_records"] == 2 and record["samples"] < count
    resumed = _loader(paths, vocab, skip=True, micro=count - record["samples"])
    resumed.load_state_dict(record, consumed_samples=record["samples"])
    np.testing.assert_array_equal(next(resumed)["text"].numpy(), expected[record["samples"]:])
    assert resumed.bad_records == 5


def test_pretrain_gpt_prints_one_line_and_exits_non_zero(webtext_data, tmp_path):
    """The command line: a malformed line in a shard is `error: FILE: line 2: ...` on stderr, exit status 1, no
    traceback, and no checkpoint written."""
    _jsonl(f"{tmp_path}/a.jsonl", [GOOD, "{broken", GOOD])
    flags = TINY_SHAPE + ["--data-path", str(tmp_path), "--vocab-file", os.path.join(webtext_data, "vocab.json"),
                          "--merge-file", os.path.join(webtext_data, "merges.txt"), "--train-iters", "2",
                          "--eval-iters", "0", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    env = dict(os.environ, MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    result = warm_python.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *flags], capture_output=True,
                             text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path}/a.jsonl: line 2: malformed JSON")
    assert not os.path.exists(tmp_path / "ckpt" / "iter_0000001")


def _free_port():
    from megatron.spawn import free_port
    return free_port()
