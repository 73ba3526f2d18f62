"""Undo WikiText's tokenization before BPE (the effect of Megatron's tasks/zeroshot_gpt/detokenizer.py, own code)."""
import re

# Plain substitutions, applied in this order.
_REPLACEMENTS = (
    ("s '", "s'"),                                         # plural possessive: "players '" -> "players'"
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),        # number / compound separators: 1 @,@ 000 -> 1,000
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
# Spaces just inside paired brackets and quotes: "( a b )" -> "(a b)".
_PAIRS = [re.compile(pattern) for pattern in
          (r"\(\s*([^\)]*?)\s*\)", r"\[\s*([^\]]*?)\s*\]", r"{\s*([^}]*?)\s*}", r"\"\s*([^\"]*?)\s*\"",
           r"'\s*([^']*?)\s*'")]
_PAIR_FORMS = ("(\\1)", "[\\1]", "{\\1}", '"\\1"', "'\\1'")
_AFTER = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),  # heading markers: " = = Title = = " -> " == Title == "
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"),                          # no spaces around line breaks
    (" N ", " 1 "),                                        # the Penn-style number placeholder
    (" 's", "'s"),                                         # clitic: "John 's" -> "John's"
)


def wikitext_detokenize(text):
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for pattern, form in zip(_PAIRS, _PAIR_FORMS):
        text = pattern.sub(form, text)
    for old, new in _AFTER:
        text = text.replace(old, new)
    return text
