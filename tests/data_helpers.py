"""Shared fixtures for the data-pipeline tests: a small corpus and a BPE trained on it, built in a temp dir."""
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO_ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

UNICODE_STRESS = (
    "Hello world! It's we're they've I'm you'll he'd. 東京は日本の首都です。 中文测试，标点。 한국어 텍스트 "
    "emoji 😀🚀👩‍👩‍👧‍👦 flags 🇯🇵 combining e\u0301 a\u0308 o\u0323\u0302 Zalgo Z\u0364\u0351a\u0336 "
    "odd spaces:\u00a0nbsp\u2009thin\u3000ideographic\ttab\r\nCRLF  double   triple\u200bzwsp "
    "literal <|endoftext|> inside text, and <|endoftext|><|endoftext|> twice. "
    "Numbers 1234567 3.14159 -42 1e-9 ١٢٣ Ⅻ; code: def f(x): return x**2  # comment\n\n\n"
    "RTL: שלום עולם مرحبا بالعالم; Cyrillic: Привет мир; Greek: Γειά σου Κόσμε; "
    "math ∑∫√∞≠≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ; lone surrogate-free edge: \U0010ffff end.  ")

HAND_DOCS = [
    "The quick brown fox jumps over the lazy dog. It barked.",
    "",
    "   ",
    "Dr. Smith went home. He was tired.\nThen he slept.",
    "A literal <|endoftext|> is ordinary text here.",
    UNICODE_STRESS,
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}, ensure_ascii=False) + "\n")
    return path


def build_small_corpus(directory, max_mb=0.3, vocab_size=1000):
    """Docstring corpus (stdlib only, ~max_mb MB) + the hand-written docs, and a BPE trained on it.

    Returns dict(corpus, vocab, merges, texts)."""
    import make_sample_corpus
    import train_tokenizer
    corpus = os.path.join(directory, "corpus.json")
    make_sample_corpus.write_corpus(corpus, max_mb=max_mb, stdlib_only=True, workers=1)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f] + HAND_DOCS
    write_jsonl(corpus, texts)
    vocab, merges, _ = train_tokenizer.train([corpus], directory, vocab_size=vocab_size)
    return {"corpus": corpus, "vocab": vocab, "merges": merges, "texts": texts}
