"""megatron/serving/rows.py: what a streamed choice shows step by step, against texts worked out by hand. Pieces are
bytes (as byte-level BPE tokens are), so one character can span two tokens."""
from megatron.serving.rows import Row

PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\n", 6: b"\n", 7: b"ok", 8: "é".encode()[:1],
          9: "é".encode()[1:], 10: b"!"}
EOD = 0


def _decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _run(tokens, max_tokens=20, **stops):
    row = Row([1], max_tokens, EOD, _decode, **stops)
    shown = [row.add(token) for token in tokens]
    return shown, row


def test_stop_string_across_tokens_is_cut_and_never_shown():
    shown, row = _run([1, 2, 3, 4, 7], stop=["o wo"])
    assert shown == ["Hel", "l", "", "", ""]         # the "o" of "Hello" might start "o wo": held back, then cut
    assert (row.text, row.finish_reason, row.tokens) == ("Hell", "stop", [1, 2, 3])


def test_held_back_prefix_released_when_it_does_not_complete():
    shown, row = _run([1, 2, 4], stop=["o wo"])
    assert shown == ["Hel", "l", "old"] and row.finish_reason is None


def test_stop_after_keeps_the_string():
    shown, row = _run([1, 5, 6, 7], stop_after=["\n\n"])
    assert "".join(shown) == row.text == "Hel\n\n" and row.finish_reason == "stop" and row.tokens == [1, 5, 6]


def test_split_character_waits_for_its_second_byte():
    shown, _ = _run([1, 8, 9, 10])
    assert shown == ["Hel", "", "é", "!"]


def test_end_of_text_and_max_tokens():
    shown, row = _run([1, 2, EOD, 3])
    assert (row.text, row.finish_reason, row.tokens, "".join(shown)) == ("Hello", "stop", [1, 2, EOD], "Hello")
    shown, row = _run([1, 2, 3], max_tokens=2)
    assert (row.text, row.finish_reason, row.tokens) == ("Hello", "length", [1, 2])
    assert Row([1], 0, EOD, _decode).finish_reason == "length"        # echo-only: nothing to generate
