"""One choice of one request while it is generated: its tokens, its text so far, where it stops and why.

    row = Row(prompt_ids, max_tokens=8, stop=["\\n"], eod=eod, detokenize=tokenizer.detokenize)
    for token in new_ids:
        delta = row.add(token)          # the text that may be shown now ("" while it might start a stop string)
        if row.finish_reason: break     # "stop" (end-of-text or a stop string) or "length"

The text shown never contains a stop string (OpenAI's `stop`) nor the start of one that may still complete; a
`stop_after` string (Megatron's stop_on_eol) is kept in the text. A token that decodes to an incomplete UTF-8
character ("\\ufffd" at the end) is held back until the next token completes it.
"""


class Row:
    def __init__(self, prompt, max_tokens, eod, detokenize, stop=(), stop_after=()):
        self.prompt, self.max_tokens, self.eod, self.detokenize = prompt, max_tokens, eod, detokenize
        self.stop, self.stop_after = list(stop), list(stop_after)
        self.tokens = []            # generated ids, the end-of-text id included
        self.text = ""              # the final text once finished; the text so far otherwise
        self.shown = 0              # characters of self.text already handed out
        self.finish_reason = None if max_tokens > 0 else "length"

    def add(self, token):
        """Take one generated id; returns the text newly safe to show."""
        if self.finish_reason:
            return ""
        self.tokens.append(token)
        if token == self.eod:
            self.finish_reason = "stop"
            return self._release(len(self.text))
        text = self.detokenize([t for t in self.tokens if t != self.eod])
        safe = len(text)
        for stop in self.stop:
            at = text.find(stop, max(0, self.shown - len(stop)))
            if at >= 0 and at <= safe:
                safe, self.finish_reason = at, "stop"
        for stop in self.stop_after:
            at = text.find(stop, max(0, self.shown - len(stop)))
            if at >= 0 and at + len(stop) <= safe:
                safe, self.finish_reason = at + len(stop), "stop"
        if self.finish_reason:
            self.text = text[:safe]
            return self._release(safe)
        self.text = text
        if len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
            return self._release(len(text))
        return self._release(safe - self._held_back(text))

    def _held_back(self, text):
        """Characters at the end of `text` that might still become a stop string or a whole character."""
        if text.endswith("\ufffd"):
            return 1
        longest = 0
        for stop in self.stop + self.stop_after:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    longest = max(longest, size)
                    break
        return longest

    def _release(self, upto):
        upto = max(upto, self.shown)
        delta = self.text[self.shown:upto]
        self.shown = upto
        return delta

