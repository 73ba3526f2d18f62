"""GPT-2 BPE tokenizer: both backends agree with each other, with HF tokenizers and with hand-computed merges."""
import argparse
import json

import pytest

from megatron.tokenizer import GPT2BPETokenizer, TokenizerFileError, build_tokenizer
from megatron.tokenizer.gpt2_tokenization import bytes_to_unicode
from tests.helpers import build_small_corpus, UNICODE_STRESS


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tokenizers_pair(small):
    fast = GPT2BPETokenizer(small["vocab"], small["merges"], backend="tiktoken")
    ref = GPT2BPETokenizer(small["vocab"], small["merges"], backend="reference")
    return fast, ref


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    assert table[0] == chr(256) and table[0xAD] == chr(256 + 67)  # 0xAD (soft hyphen) is the last unprintable


def test_backends_identical_ids_and_exact_round_trip(small, tokenizers_pair):
    fast, ref = tokenizers_pair
    assert (fast.backend, ref.backend) == ("tiktoken", "reference")
    for text in small["texts"] + [UNICODE_STRESS]:
        ids = fast.tokenize(text)
        assert ids == ref.tokenize(text)
        assert fast.detokenize(ids) == text and ref.detokenize(ids) == text


def test_literal_endoftext_is_ordinary_text(tokenizers_pair):
    for tok in tokenizers_pair:
        ids = tok.tokenize("a<|endoftext|>b")
        assert tok.eod not in ids and len(ids) > 3
        assert tok.detokenize(ids + [tok.eod]) == "a<|endoftext|>b<|endoftext|>"


def test_lone_surrogates_become_replacement_characters(tokenizers_pair):
    fast, ref = tokenizers_pair
    text = "ab\ud800cd \udc00\ud83d \ud83d\ude00"  # lone halves, and a pair as json.loads never leaves it
    assert fast.tokenize(text) == ref.tokenize(text) == ref.tokenize("ab\ufffdcd \ufffd\ufffd \U0001f600")


def test_same_ids_as_hugging_face_tokenizers(small, tokenizers_pair):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    hf = Tokenizer(models.BPE.from_file(small["vocab"], small["merges"]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    fast, _ = tokenizers_pair
    for text in small["texts"][:200] + [UNICODE_STRESS]:
        assert fast.tokenize(text) == hf.encode(text).ids


def _hand_made_files(tmp_path, merges):
    vocab = {"<|endoftext|>": 0}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                         encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


@pytest.mark.parametrize("backend", ["tiktoken", "reference"])
def test_hand_computed_merges(tmp_path, backend):
    vocab_file, merge_file, vocab = _hand_made_files(tmp_path, [("h", "e"), ("l", "l"), ("he", "ll"),
                                                                ("Ġ", "w"), ("hell", "o")])
    tok = GPT2BPETokenizer(vocab_file, merge_file, backend=backend)
    # "hello" -> h e l l o -> he l l o -> he ll o -> hell o -> hello; " world" -> Ġw o r l d
    assert tok.tokenize("hello world") == [vocab["hello"], vocab["Ġw"], vocab["o"], vocab["r"], vocab["l"],
                                           vocab["d"]]
    # "hel" has no (he, l) merge: stays he + l
    assert tok.tokenize("hel") == [vocab["he"], vocab["l"]]
    assert tok.eod == 0 and tok.vocab_size == 256 + 5 + 1


def test_build_tokenizer_pads_vocab(small, capsys):
    args = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=small["vocab"],
                              merge_file=small["merges"], make_vocab_size_divisible_by=128, model_parallel_size=3,
                              rank=0)
    tok = build_tokenizer(args)
    assert tok.vocab_size == 1000 and args.padded_vocab_size == 1152  # multiple of 384 >= 1000
    assert "new size: 1152" in capsys.readouterr().out


def test_missing_and_mismatched_files(tmp_path, small):
    with pytest.raises(TokenizerFileError, match="not found.*nope.json"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), small["merges"])
    vocab_file, merge_file, _ = _hand_made_files(tmp_path, [("h", "e")])
    bad_merges = tmp_path / "bad_merges.txt"
    bad_merges.write_text("#version: 0.2\nh e\nhe zzz\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"bad_merges.txt:3: .*'zzz'.*vocab and merges do not match"):
        GPT2BPETokenizer(vocab_file, str(bad_merges))
    # a real mismatch: the small corpus' merges against a hand-made vocab
    with pytest.raises(TokenizerFileError, match="merges.txt:2: .*do not match"):
        GPT2BPETokenizer(vocab_file, small["merges"])
    no_eod = tmp_path / "no_eod.json"
    vocab = json.loads(open(vocab_file).read())
    del vocab["<|endoftext|>"]
    no_eod.write_text(json.dumps(vocab))
    with pytest.raises(TokenizerFileError, match=r"no_eod.json: has no <\|endoftext\|>"):
        GPT2BPETokenizer(str(no_eod), merge_file)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TokenizerFileError, match="junk.json: not a JSON vocab"):
        GPT2BPETokenizer(str(tmp_path / "junk.json"), merge_file)


def test_tiktoken_refuses_merges_it_cannot_reproduce(tmp_path):
    # two merges making the same token: GPT-2 ranks them separately, tiktoken cannot
    vocab_file, merge_file, _ = _hand_made_files(tmp_path, [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")])
    with pytest.raises(ValueError, match="tiktoken cannot reproduce"):
        GPT2BPETokenizer(vocab_file, merge_file, backend="tiktoken")
    auto = GPT2BPETokenizer(vocab_file, merge_file)
    assert auto.backend == "reference"
    assert auto.detokenize(auto.tokenize("abcabc")) == "abcabc"
