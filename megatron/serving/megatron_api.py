"""Megatron-LM's REST API (tools/run_text_generation_server.py, `PUT /api`), its fields checked as Megatron checks
them and each one honoured, or refused by name:

    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["Hello"], "tokens_to_generate": 16, "top_k": 1, "logprobs": true}'
    -> {"text": ["Hello ..."], "segments": [["Hello", " ..."]], "logprobs": [[-2.1, ...]]}

    prompts                 list of strings (required)
    tokens_to_generate      new tokens per prompt (default 64); 0 scores the prompts (needs logprobs)
    logprobs                per prompt, the log-probability of every token after the first
    temperature             (0, 100], default 1.0 (Megatron samples by default)
    top_k / top_p           top_k 1 is greedy; only one of the two (Megatron's rule)
    add_BOS                 prepend the end-of-text id to each prompt
    stop_on_eol             stop after the first newline generated (it stays in the text)
    stop_on_double_eol      stop after the first blank line ("\\n\\n") generated
    random_seed             the sampling seed (-1, the default: a fresh one per request)
    no_log                  accepted: this server logs no request texts anyway
    prevent_newline_after_colon, top_p_decay, top_p_bound, beam_width, length_penalty, stop_token, all_probs:
    refused unless off (no logits processing, no beam search, no whole-vocabulary distributions here)

"text" is each prompt followed by its generation (the end-of-text token is not shown); "segments" its tokens as
strings. Errors are OpenAI error objects (app.py), not Megatron's bare strings.
"""
import random

from .protocol import (APIError, GenerationRequest, check, check_context, prompt_ids, refuse_unknown,
                       refuse_unless_off, take)

FIELDS = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS", "stop_on_eol",
          "stop_on_double_eol", "random_seed", "no_log", "prevent_newline_after_colon", "top_p_decay", "top_p_bound",
          "beam_width", "length_penalty", "stop_token", "all_probs")


def parse(body, limits):
    """PUT /api's body -> GenerationRequest."""
    refuse_unknown(body, FIELDS, "PUT /api")
    refuse_unless_off(body, "prevent_newline_after_colon", (False,), "no logits processing")
    refuse_unless_off(body, "all_probs", (False,), "no whole-vocabulary distributions are returned")
    refuse_unless_off(body, "top_p_decay", (0, 0.0), "top-p is not decayed")
    refuse_unless_off(body, "top_p_bound", (0, 0.0), "top-p is not decayed")
    for name in ("beam_width", "length_penalty", "stop_token"):
        refuse_unless_off(body, name, (None,), "no beam search")
    prompts = take(body, "prompts", (list,), None)
    if prompts is None:
        raise APIError(400, "prompts is missing: give a list of strings", "prompts", "missing_field")
    check(prompts and all(isinstance(p, str) for p in prompts), "prompts", "must be a non-empty list of strings")
    tokens = take(body, "tokens_to_generate", (int,), 64)
    check(tokens >= 0, "tokens_to_generate", f"is {tokens}: it must be >= 0")
    logprobs = take(body, "logprobs", (bool,), False)
    check(tokens > 0 or logprobs, "tokens_to_generate", "is 0 (score the prompts): set logprobs to true")
    temperature = take(body, "temperature", (float,), 1.0)
    check(0.0 < temperature <= 100.0, "temperature", f"is {temperature}: give a value in (0, 100]")
    top_k = take(body, "top_k", (int,), 0)
    check(0 <= top_k <= 1000, "top_k", f"is {top_k}: give 0 (off) to 1000")
    top_p = take(body, "top_p", (float,), 0.0)
    check(0.0 <= top_p <= 1.0, "top_p", f"is {top_p}: give 0 (off) to 1")
    check(not (top_k and top_p), "top_p", "and top_k are both set: use one of them (Megatron's rule)")
    seed = take(body, "random_seed", (int,), -1)
    check(seed >= -1, "random_seed", f"is {seed}: give a seed >= 0 (or -1 for a fresh one)")
    ids = prompt_ids(prompts, limits, "prompts")
    if take(body, "add_BOS", (bool,), False):
        ids = [[limits.tokenizer.eod] + p for p in ids]
    check_context(ids, tokens, limits, "tokens_to_generate")
    take(body, "no_log", (bool,), False)
    stop_after = [text for name, text in (("stop_on_double_eol", "\n\n"), ("stop_on_eol", "\n"))
                  if take(body, name, (bool,), False)][-1:]     # "\n" stops first when both are set
    return GenerationRequest(prompts=ids, max_tokens=tokens, greedy=top_k == 1, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed if seed >= 0 else random.randrange(2 ** 31),
                             stop_after=stop_after, logprobs=0 if logprobs else None)


def answer(work, decode):
    """Megatron's response: text (prompt + generation), segments (token strings), logprobs when asked."""
    out = {"text": [decode(row.prompt) + row.text for row in work.rows],
           "segments": [[decode([t]) for t in row.prompt + row.tokens] for row in work.rows]}
    if work.request.logprobs is not None:
        out["logprobs"] = [scores[0][1:] for scores in work.scores]
    return out
