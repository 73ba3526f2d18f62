"""GPT-2 byte-level BPE, read from GPT-2-format `vocab.json` + `merges.txt`.

Two encoders with identical ids behind one interface (`encode(text) -> list[int]`, `decode(ids) -> str`):

- `ReferenceBPE`: the original GPT-2 algorithm (openai/gpt-2 `encoder.py`) in Python with `regex`:
  text -> pre-tokens by GPT-2's split pattern -> UTF-8 bytes mapped to printable unicode (`bytes_to_unicode`) ->
  repeatedly merge the adjacent pair with the lowest merge rank -> vocab ids. A bounded LRU cache holds BPE results.
- `TiktokenBPE`: the same files handed to tiktoken's Rust BPE (no download): mergeable rank of a token = its vocab id.
  tiktoken merges the adjacent pair whose *concatenation* has the lowest rank, which equals GPT-2's rule when every
  merge creates a new token whose id grows with the merge's line number (true for GPT-2's files and for files
  written by tools/train_tokenizer.py); `TiktokenBPE` refuses files where that does not hold.

A literal `<|endoftext|>` in the text is ordinary text in both (split into `<`, `|`, `end`, ...), as in GPT-2's
own encoder; callers append the eod id themselves. Lone surrogates (possible in JSON `\ud800` escapes) cannot be
UTF-8 encoded; both encoders replace them with U+FFFD (tiktoken's rule).

Worked example of the byte table: byte 0x20 (space) is not printable, so it maps to chr(256 + 32) = 'Ġ';
" the" -> pre-token " the" -> 'Ġthe' -> BPE merges ('Ġ','t') ('h','e') ('Ġt','he') -> one id.
"""
import functools
import json
import os

from megatron.cli import UserError

# GPT-2's pre-tokenizer pattern (openai/gpt-2 encoder.py); tiktoken's "gpt2" pat_str is the same pattern written
# with a non-capturing group for the contractions.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


class TokenizerFileError(UserError, ValueError):
    """A vocab or merges file that is missing, malformed, or does not match its partner."""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode():
    """Map every byte 0..255 to a printable unicode character (GPT-2's table; bytes already printable map to
    themselves, the other 68 to chr(256), chr(257), ... in byte order)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    byte_values, code_points = list(printable), list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + extra)
            extra += 1
    return dict(zip(byte_values, map(chr, code_points)))


def load_vocab_and_merges(vocab_file, merge_file):
    """Read and cross-check the two files.

    Returns (encoder: {token str: id}, merges: [(left, right)] in rank order). Raises TokenizerFileError naming
    the file and the problem: missing file, bad JSON, a merges line that is not two tokens, a merge whose parts
    or result are not in the vocab, duplicate ids, a missing byte token or a missing `<|endoftext|>`.
    """
    for path in (vocab_file, merge_file):
        if path is None or not os.path.isfile(path):
            raise TokenizerFileError(f"tokenizer file not found: {path!r}")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerFileError(f"{vocab_file}: not a JSON vocab file ({exc})") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise TokenizerFileError(f"{vocab_file}: expected a JSON object {{token: integer id}}")
    if len(set(encoder.values())) != len(encoder):
        raise TokenizerFileError(f"{vocab_file}: two tokens share one id")
    if EOD_TOKEN not in encoder:
        raise TokenizerFileError(f"{vocab_file}: has no {EOD_TOKEN} token (needed as the end-of-document id)")
    missing_bytes = [c for c in bytes_to_unicode().values() if c not in encoder]
    if missing_bytes:
        raise TokenizerFileError(f"{vocab_file}: not a byte-level BPE vocab, {len(missing_bytes)} of the 256 byte "
                                 f"tokens are missing (e.g. {missing_bytes[0]!r})")
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if (line_number == 1 and line.startswith("#version")) or not line:
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise TokenizerFileError(f"{merge_file}:{line_number}: expected two space-separated tokens, "
                                         f"got {line!r}")
            left, right = parts
            for token in (left, right, left + right):
                if token not in encoder:
                    raise TokenizerFileError(
                        f"{merge_file}:{line_number}: merge {line!r} uses token {token!r} that is not in "
                        f"{vocab_file} (vocab and merges do not match)")
            merges.append((left, right))
    return encoder, merges


def _get_pairs(word):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


class ReferenceBPE:
    """GPT-2's encoder in Python (regex + ranked merges + bounded cache); the reference for `TiktokenBPE`."""

    def __init__(self, encoder, merges, cache_size=1 << 16):
        import regex
        self.encoder = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.bpe = functools.lru_cache(maxsize=cache_size)(self._bpe)

    def _bpe(self, token):
        """Merge the characters of one byte-mapped pre-token; returns the tuple of resulting vocab strings."""
        word = tuple(token)
        pairs = _get_pairs(word)
        while pairs:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            merged, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    merged.extend(word[i:])
                    break
                merged.extend(word[i:j])
                i = j
                if i < len(word) - 1 and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            if len(word) == 1:
                break
            pairs = _get_pairs(word)
        return word

    def encode(self, text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (e.g. from JSON escapes) -> U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        ids = []
        for piece in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[token] for token in self.bpe(mapped))
        return ids

    def decode(self, ids):
        text = "".join(self.decoder[i] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


class TiktokenBPE:
    """The same BPE run by tiktoken, built offline from the vocab and merges (rank = vocab id)."""

    def __init__(self, encoder, merges, name="gpt2_bpe_from_files"):
        import tiktoken
        byte_decoder = {v: k for k, v in bytes_to_unicode().items()}
        check_ranks_follow_merges(encoder, merges)
        ranks = {bytes(byte_decoder[c] for c in token): i for token, i in encoder.items() if token != EOD_TOKEN}
        self.encoding = tiktoken.Encoding(
            name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
            special_tokens={EOD_TOKEN: encoder[EOD_TOKEN]})

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")


def check_ranks_follow_merges(encoder, merges):
    """Raise ValueError unless tiktoken's rule (lowest id of the concatenation) equals GPT-2's (lowest merge line).

    Holds when each merge creates a token whose id is larger than that of every earlier merge, and every token
    other than the 256 bytes and `<|endoftext|>` is created by exactly one merge.
    """
    previous = -1
    for line, (left, right) in enumerate(merges, 1):
        token_id = encoder[left + right]
        if token_id <= previous:
            raise ValueError(f"merge {line} ({left} {right}) makes id {token_id}, not above the previous merge's "
                             f"id {previous}: ids do not follow merge order")
        previous = token_id
    made_by_merges = len(merges) + 256 + 1
    if made_by_merges != len(encoder):
        raise ValueError(f"vocab has {len(encoder)} tokens but bytes + merges + eod make {made_by_merges}")
