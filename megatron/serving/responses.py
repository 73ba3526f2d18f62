"""Finished Work -> the JSON each API answers (OpenAI's completions and chat completions, their stream chunks)."""
import time
import uuid


def new_id(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(work):
    prompt = sum(len(p) for p in work.request.prompts)
    completion = sum(len(row.tokens) for row in work.rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(row, scores, want, echo, decode):
    """OpenAI's legacy logprobs object of one choice: tokens, token_logprobs, top_logprobs, text_offset, over the
    prompt too with echo (its first token has no log-probability: None, as OpenAI and vLLM give)."""
    log_probs, tops = scores
    start = 0 if echo else len(row.prompt)
    ids = (row.prompt + row.tokens)[start:]
    tokens = [decode([t]) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top_logprobs = [None if top is None else {decode([i]): lp for i, lp in list(top.items())[:want]}
                    for top in tops[start:]]
    return {"tokens": tokens, "token_logprobs": log_probs[start:], "top_logprobs": top_logprobs,
            "text_offset": offsets}


def completion(work, model, decode):
    request = work.request
    choices = []
    for index, row in enumerate(work.rows):
        text = (decode(row.prompt) if request.echo else "") + row.text
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(row, work.scores[index], request.logprobs, request.echo, decode)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": row.finish_reason})
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(work)}


def completion_chunk(ident, model, index, text, finish_reason=None):
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_content(row, template):
    """The answer's text without the space the template puts between " Assistant:" and the answer."""
    return row.text[len(template.response_prefix):] if row.text.startswith(template.response_prefix) else row.text


def chat_logprobs(row, scores, top, decode):
    log_probs, tops = scores
    start = len(row.prompt)
    content = []
    for token, lp, alternatives in zip(row.tokens, log_probs[start:], tops[start:]):
        text = decode([token])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": decode([i]), "logprob": v,
                                          "bytes": list(decode([i]).encode("utf-8"))}
                                         for i, v in list(alternatives.items())[:top]]})
    return {"content": content}


def chat(work, model, template, decode):
    choices = []
    for index, row in enumerate(work.rows):
        logprobs = None
        if work.request.logprobs is not None:
            logprobs = chat_logprobs(row, work.scores[index], work.request.logprobs, decode)
        choices.append({"index": index, "message": {"role": "assistant", "content": chat_content(row, template)},
                        "logprobs": logprobs, "finish_reason": row.finish_reason})
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(work)}


def chat_chunk(ident, model, index, delta, finish_reason=None):
    return {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
