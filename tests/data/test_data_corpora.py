"""--train-data / --data-path resolution: a missing corpus prints the exact command that builds it."""
import numpy as np
import pytest

from megatron.data.corpora import resolve_corpus, resolve_data_path
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def test_missing_webtext_prints_the_command(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        resolve_corpus("webtext", root=str(tmp_path))
    message = str(info.value)
    assert "data/webtext/webtext_text_document.idx" in message
    assert "python tools/prepare_default_data.py" in message
    assert "python tools/preprocess_data.py --input data/webtext/webtext.json --output-prefix data/webtext/webtext" \
        in message
    with pytest.raises(ValueError, match="unknown --train-data 'nope'"):
        resolve_corpus("nope")


def test_resolve(tmp_path):
    prefix = str(tmp_path / "data" / "webtext" / "webtext_text_document")
    (tmp_path / "data" / "webtext").mkdir(parents=True)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert resolve_corpus("webtext", root=str(tmp_path)) == prefix
    assert resolve_data_path(None, "webtext", root=str(tmp_path)) == [prefix]
    assert resolve_data_path([prefix]) == [prefix]
    assert resolve_data_path(["0.3", prefix, "0.7", prefix]) == ["0.3", prefix, "0.7", prefix]
    assert resolve_data_path(f"1 {prefix}") == ["1", prefix]
    with pytest.raises(FileNotFoundError, match="missing .*nothing.idx"):
        resolve_data_path([str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match="either --data-path or --train-data"):
        resolve_data_path([prefix], "webtext")
