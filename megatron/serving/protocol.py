"""The server's request schema: each endpoint's JSON body checked field by field into one GenerationRequest, and
the OpenAI-style error every refusal becomes.

    request = parse_completion(body, limits)      # APIError(400, "max_tokens is 'ten': expected an integer", ...)
    APIError(...).body() == {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

A field nobody handles is refused by name (an unknown field would otherwise be silently ignored, and a client would
believe it had an effect); a field the OpenAI or Megatron API defines but this server does not implement (beam
search, penalties, logit_bias) is accepted only at its "off" value and otherwise refused by name.
"""
from dataclasses import dataclass, field

from megatron.cli import UserError
from megatron.posttrain import ExampleError, checked_messages

MAX_LOGPROBS = 20
"""The most alternatives `logprobs` may ask for per token (OpenAI allows 5; vLLM 20)."""


class APIError(UserError, ValueError):
    """A refused request (a client's bad input): HTTP `status` and the OpenAI error object naming the problem
    (`param`: the field). The app answers it; it never reaches run_main."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What a request is checked against: the checkpoint's context and vocabulary, the tokenizer."""
    max_positions: int
    vocab_size: int
    tokenizer: object


@dataclass
class GenerationRequest:
    """One request as the batcher runs it: `prompts` (token ids) each continued `n` times."""
    prompts: list
    max_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 1234
    n: int = 1
    stop: list = field(default_factory=list)          # stop strings, cut from the text (OpenAI)
    stop_after: list = field(default_factory=list)    # stop strings kept in the text (Megatron's stop_on_eol)
    logprobs: int = None                              # alternatives per token; None: no logprobs
    echo: bool = False                                # the prompt's tokens (and logprobs) in the output
    stream: bool = False
    include_usage: bool = False                       # a last stream chunk with the usage (stream_options)

    @property
    def sampled(self):
        return not self.greedy


def kind_name(kinds):
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


def take(body, name, kinds, default):
    """body[name] when it has one of `kinds` (bool is never an int; an int is a float), else `default`."""
    if name not in body or (body[name] is None and type(None) not in kinds):
        return default
    value = body[name]
    ok = any(isinstance(value, k) and not (k in (int, float) and isinstance(value, bool)) for k in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise APIError(400, f"{name} is {value!r}: expected {kind_name(kinds)}", name, "invalid_type")
    return value


def check(condition, name, message):
    if not condition:
        raise APIError(400, f"{name} {message}", name, "invalid_value")


def refuse_unknown(body, known, endpoint):
    if not isinstance(body, dict):
        raise APIError(400, f"the body of {endpoint} must be a JSON object, got {type(body).__name__}", None,
                       "invalid_type")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r} for {endpoint} (known: {', '.join(sorted(known))})",
                       unknown[0], "unknown_field")


def refuse_unless_off(body, name, off, why):
    if name in body and body[name] not in off:
        raise APIError(400, f"{name} is not supported by this server ({why}); leave it out", name, "unsupported")


def prompt_ids(prompt, limits, name="prompt"):
    """The prompt field (a string, a list of strings, a list of ids, a list of lists of ids) as lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, f"{name} is empty or not a string, a list of strings or token ids", name,
                       "invalid_value" if isinstance(prompt, list) else "invalid_type")
    out = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            ids = limits.tokenizer.tokenize(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            check(not bad, name, f"[{index}] has token ids outside the vocabulary [0, {limits.vocab_size}): "
                                  f"{bad[:5]}")
        else:
            raise APIError(400, f"{name}[{index}] is {item!r}: expected a string or a list of token ids", name,
                           "invalid_type")
        check(ids, name, f"[{index}] is empty: give at least one token")
        out.append(ids)
    return out


def check_context(prompts, max_tokens, limits, name="max_tokens"):
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > limits.max_positions:
        raise APIError(400, f"{name} {max_tokens} + the prompt's {longest} tokens is past the model's context of "
                            f"{limits.max_positions} tokens: ask for at most {max(0, limits.max_positions - longest)}",
                       name, "context_length_exceeded")


def _openai_sampling(body, max_tokens_default):
    """The sampling fields the completions and chat endpoints share, into GenerationRequest keywords."""
    temperature = take(body, "temperature", (float,), 1.0)
    check(0.0 <= temperature <= 2.0, "temperature", f"is {temperature}: give a value in [0, 2] (0: greedy)")
    top_p = take(body, "top_p", (float,), 1.0)
    check(0.0 < top_p <= 1.0, "top_p", f"is {top_p}: give a probability mass in (0, 1]")
    top_k = take(body, "top_k", (int,), 0)
    check(top_k >= -1, "top_k", f"is {top_k}: give -1 or 0 (off) or the number of most likely tokens")
    n = take(body, "n", (int,), 1)
    check(1 <= n <= 128, "n", f"is {n}: give 1 to 128 choices")
    max_tokens = take(body, "max_tokens", (int,), max_tokens_default)
    check(max_tokens >= 0, "max_tokens", f"is {max_tokens}: it must be >= 0")
    stop = take(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    check(all(isinstance(s, str) and s for s in stop) and len(stop) <= 4, "stop",
           "must be a non-empty string or a list of up to 4 of them")
    seed = take(body, "seed", (int,), 1234)
    stream = take(body, "stream", (bool,), False)
    stream_options = take(body, "stream_options", (dict,), None)
    if stream_options is not None:
        check(stream and set(stream_options) <= {"include_usage"}, "stream_options",
               "is only for stream: true, with the one key include_usage")
    for name in ("presence_penalty", "frequency_penalty"):
        refuse_unless_off(body, name, (0, 0.0, None), "no penalties are applied")
    refuse_unless_off(body, "logit_bias", ({}, None), "logits are not biased")
    return dict(max_tokens=max_tokens, greedy=temperature == 0.0, temperature=temperature or 1.0,
                top_k=max(top_k, 0), top_p=0.0 if top_p == 1.0 else top_p, seed=seed, n=n, stop=stop,
                stream=stream, include_usage=bool(stream_options and stream_options.get("include_usage")))


SHARED_FIELDS = ("model", "temperature", "top_p", "top_k", "n", "max_tokens", "stop", "seed", "stream",
                 "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "user")
COMPLETION_FIELDS = SHARED_FIELDS + ("prompt", "logprobs", "echo", "best_of", "suffix")
CHAT_FIELDS = SHARED_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")


def parse_completion(body, limits):
    """POST /v1/completions' body -> GenerationRequest (APIError naming the first bad field)."""
    refuse_unknown(body, COMPLETION_FIELDS, "/v1/completions")
    refuse_unless_off(body, "best_of", (1, None), "one completion per choice")
    refuse_unless_off(body, "suffix", ("", None), "no insertion")
    if "prompt" not in body:
        raise APIError(400, "prompt is missing: give a string, a list of strings or token ids", "prompt",
                       "missing_field")
    prompts = prompt_ids(body["prompt"], limits)
    logprobs = take(body, "logprobs", (int,), None)
    check(logprobs is None or 0 <= logprobs <= MAX_LOGPROBS, "logprobs", f"is {logprobs}: give 0 to {MAX_LOGPROBS}")
    request = GenerationRequest(prompts=prompts, logprobs=logprobs, echo=take(body, "echo", (bool,), False),
                                **_openai_sampling(body, 16))
    check(not (request.stream and (logprobs is not None or request.echo)), "stream",
          "cannot be combined with logprobs or echo on this server: ask without stream")
    check_context(prompts, request.max_tokens, limits)
    check(request.max_tokens > 0 or request.echo, "max_tokens", "is 0: ask for at least 1 token (or echo)")
    return request


def parse_chat(body, limits, template):
    """POST /v1/chat/completions' body -> (GenerationRequest, top_logprobs or None); the messages become the
    prompt of `template` (megatron.posttrain's chat format, what finetune_gpt.py trained on)."""
    from megatron.posttrain import encode_prompt
    refuse_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    try:
        messages = checked_messages(body.get("messages"), for_generation=True)
    except ExampleError as error:
        raise APIError(400, f"messages: {error}", "messages", "invalid_value") from None
    sampling = _openai_sampling(body, None)
    completion_tokens = take(body, "max_completion_tokens", (int,), None)
    prompt = encode_prompt(messages, limits.tokenizer, template)
    room = limits.max_positions - len(prompt)
    if sampling["max_tokens"] is None:
        sampling["max_tokens"] = completion_tokens if completion_tokens is not None else max(room, 1)
    check(sampling["max_tokens"] >= 1, "max_tokens", "must be at least 1")
    check_context([prompt], sampling["max_tokens"], limits)
    want = take(body, "logprobs", (bool,), False)
    top = take(body, "top_logprobs", (int,), 0)
    check(0 <= top <= MAX_LOGPROBS and (want or not top), "top_logprobs",
           f"is {top}: give 0 to {MAX_LOGPROBS}, with logprobs: true")
    check(not (sampling["stream"] and want), "stream", "cannot be combined with logprobs on this server: ask "
          "without stream")
    return GenerationRequest(prompts=[prompt], logprobs=top if want else None, **sampling)
