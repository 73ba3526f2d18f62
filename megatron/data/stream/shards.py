"""Raw corpus shards for --data-path: which files a path names, and their rows read one by one.

    shards = list_shards("fineweb/sample/")       # sorted .jsonl, .jsonl.gz, .json and .parquet files under it
    for row, raw in read_rows(shards[0], "text", start_row=0):
        text, bad = document_text(shards[0], row, raw, "text")

A row is one document slot: a non-blank line of JSON lines (`row` = line number - 1; .json is loose JSON, one object
a line, as tools/preprocess_data.py reads it; .json.gz and .jsonl.gz are gzipped), or one Parquet row (pyarrow, imported only here). Reading is lazy:
nothing is opened before the stream reaches the shard, so the first batch never waits for a scan of the corpus.

Rows are the same for every reader of a shard: a JSON line is parsed only by the worker that owns its row
(document_text), the others only count it. What cannot be read is a row too, holding a BadRecord that names the
file and row: an empty shard (row 0), a truncated gzip or Parquet file (at the first row it cannot read).
"""
import gzip
import json
import os
import zlib
from typing import NamedTuple

from megatron.cli import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


class StreamDataError(UserError, ValueError):
    """Raw shards that cannot be streamed: a path or glob that names no shard, or a bad record (file and row)
    without --skip-bad-records."""


class BadRecord(NamedTuple):
    message: str
    """'FILE: line N: what is wrong' (JSON lines) or 'FILE: row N: ...' (Parquet)."""


def is_stream_path(path):
    """A directory, a glob or a file of raw shards (an indexed dataset's --data-path is a prefix of .bin/.idx)."""
    return os.path.isdir(path) or any(c in path for c in "*?[") or path.endswith(SUFFIXES)


def list_shards(path):
    """The shard files `path` names, sorted: every shard file under a directory (recursively), the shard files
    a glob matches, or the file itself. StreamDataError when there is none."""
    if os.path.isdir(path):
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                 if name.endswith(SUFFIXES)]
    elif any(c in path for c in "*?["):
        import glob
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f) and f.endswith(SUFFIXES)]
    elif os.path.isfile(path):
        if not path.endswith(SUFFIXES):
            raise StreamDataError(f"--data-path {path}: not a shard file (expected {', '.join(SUFFIXES)})")
        files = [path]
    else:
        raise StreamDataError(f"--data-path {path}: no such file or directory")
    if not files:
        raise StreamDataError(f"--data-path {path}: matches no {', '.join(SUFFIXES)} file; check the path or glob")
    return sorted(files)


def read_rows(path, key, start_row=0):
    """(row, raw) of the shard from `start_row` on: raw is a JSON line's bytes, a Parquet cell's value, or a
    BadRecord. A shard without a single row gives one BadRecord at row 0."""
    rows = _parquet_rows(path, key, start_row) if path.endswith(".parquet") else _json_rows(path, start_row)
    empty = start_row == 0
    for row, raw in rows:
        empty = False
        yield row, raw
    if empty:
        yield 0, BadRecord(f"{path}: row 0: empty shard (no documents)")


def _json_rows(path, start_row):
    opener = gzip.open if path.endswith(".gz") else open
    lines_read = 0
    try:
        with opener(path, "rb") as f:
            for row, line in enumerate(f):
                lines_read = row + 1
                if row >= start_row and line.strip():
                    yield row, line
    except (OSError, EOFError, zlib.error) as exc:   # a truncated or corrupt .gz
        row = max(lines_read, start_row)
        yield row, BadRecord(f"{path}: line {row + 1}: unreadable ({_one_line(exc)})")


def _parquet_rows(path, key, start_row):
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:              # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        yield start_row, BadRecord(f"{path}: row {start_row}: unreadable Parquet file ({_one_line(exc)})")
        return
    if key not in parquet.schema_arrow.names:
        yield start_row, BadRecord(f"{path}: row {start_row}: missing key {key!r} (columns: "
                                   f"{parquet.schema_arrow.names[:10]})")
        return
    first = 0
    for group in range(parquet.num_row_groups):
        count = parquet.metadata.row_group(group).num_rows
        if first + count > start_row:
            try:
                values = parquet.read_row_group(group, columns=[key]).column(0).to_pylist()
            except (OSError, ValueError) as exc:
                row = max(first, start_row)
                yield row, BadRecord(f"{path}: row {row}: unreadable Parquet row group {group} ({_one_line(exc)})")
                return
            for offset in range(max(start_row - first, 0), count):
                yield first + offset, values[offset]
        first += count


def _one_line(exc):
    return " ".join(str(exc).split())


def document_text(path, row, raw, key):
    """(text, None) of a row, or (None, message) when it is not a document with a string under `key`."""
    if isinstance(raw, BadRecord):
        return None, raw.message
    if isinstance(raw, bytes):
        where = f"{path}: line {row + 1}"
        try:
            doc = json.loads(raw)
        except ValueError as exc:          # JSONDecodeError and UnicodeDecodeError
            return None, f"{where}: malformed JSON ({exc})"
        if not isinstance(doc, dict):
            return None, f"{where}: expected a JSON object, got {type(doc).__name__}"
        if key not in doc:
            return None, f"{where}: missing key {key!r} (keys: {sorted(doc)[:10]})"
        raw = doc[key]
    else:
        where = f"{path}: row {row}"
        if raw is None:
            return None, f"{where}: missing key {key!r} (null)"
    if not isinstance(raw, str):
        return None, f"{where}: key {key!r} is {type(raw).__name__}, expected a string"
    return raw, None


def shards_digest(shards, root):
    """A short fingerprint of the shard list (names relative to `root`), saved with the stream's position."""
    import hashlib
    names = "\n".join(os.path.relpath(s, root) if os.path.isdir(root) else os.path.basename(s) for s in shards)
    return hashlib.sha256(names.encode()).hexdigest()[:16]


