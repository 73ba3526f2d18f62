"""SFT examples as pure functions: chat templates, one example -> token ids + loss mask, packing into rows.

    messages = parse_example(json.loads(line))         # {"prompt", "response"} or {"messages": [...]}
    chosen, rejected = parse_preference(json.loads(line))   # {"prompt", "chosen", "rejected"}: two conversations
    ids, mask = encode_example(messages, tokenizer, TEMPLATES["deepspeed-chat"])
    prompt = encode_prompt([{"role": "user", "content": "Hi"}], tokenizer, template)   # ends with " Assistant:"
    packs = pack_examples(lengths, capacity=seq_length + 1)  # [[0, 1], [2], ...]: example indices per row
    row = assemble_row([(ids0, mask0), (ids1, mask1)], capacity, pad_id=eod)   # {"text", "loss_mask", "segments"}

The default template, deepspeed-chat, is DeepSpeed-Chat's format (its PromptRawDataset: prompt
" Human: " + prompt + " Assistant:", answer " " + response, then its end_of_conversation_token <|endoftext|>).
{"prompt": "Hi", "response": "Hello!"} becomes

    segment      " Human: Hi"   " Assistant:"   " Hello!"   <|endoftext|>
    loss mask         0              0              1             1

A multi-turn {"messages": [...]} (roles system, user, assistant; system only first; the last turn an assistant's)
gives each assistant turn the same prompt part (" Assistant:", mask 0) then its answer and an end-of-text (mask
1); system (" System: ...") and user turns are mask 0. So the loss covers every answer and nothing else. "hh" is
the Anthropic HH-RLHF layout DeepSpeed-Chat's default datasets carry ("\\n\\nHuman: ...\\n\\nAssistant: ...").
Each segment is tokenized on its own and the ids concatenated: a mask boundary is always a token boundary, and
the generation prompt (encode_prompt) is exactly the ids the model saw before an answer in training.

Lengths: an example of n tokens trains n - 1 predictions (token t + 1 from tokens 0..t), so it fits a model of
--seq-length S when n <= S + 1; truncate_example keeps the first S + 1 tokens (the start: the prompt and the
beginning of the answer).
"""
from dataclasses import dataclass

import numpy as np

from megatron.cli import UserError

ROLES = ("system", "user", "assistant")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    """--chat-template NAME."""
    system_prefix: str
    """Put before a system message's content (mask 0)."""
    user_prefix: str
    """Put before a user message's content (mask 0)."""
    assistant_prefix: str
    """The prompt part that opens an assistant turn (mask 0); generation prompts end with it."""
    response_prefix: str
    """Put before an assistant message's content (mask 1, like the content and the end-of-text after it)."""


TEMPLATES = {template.name: template for template in (
    ChatTemplate("deepspeed-chat", system_prefix=" System: ", user_prefix=" Human: ", assistant_prefix=" Assistant:",
                 response_prefix=" "),
    ChatTemplate("hh", system_prefix="", user_prefix="\n\nHuman: ", assistant_prefix="\n\nAssistant:",
                 response_prefix=" "),
)}
DEFAULT_TEMPLATE = "deepspeed-chat"


class ExampleError(UserError, ValueError):
    """An example that cannot be used; the message says why (the caller prefixes FILE:LINE)."""


def parse_example(record):
    """A decoded JSON line -> its messages [{"role", "content"}, ...]; ExampleError naming what is wrong."""
    if not isinstance(record, dict):
        raise ExampleError(f"expected a JSON object, got {type(record).__name__}")
    pair = [key for key in ("prompt", "response") if key in record]
    if "messages" in record and pair:
        raise ExampleError(f"has both 'messages' and {pair[0]!r}: give either prompt/response or messages")
    if "messages" in record:
        return checked_messages(record["messages"])
    if not pair:
        raise ExampleError(f"expected keys 'prompt' and 'response', or 'messages' (keys: {sorted(record)[:10]})")
    for key in ("prompt", "response"):
        if key not in record:
            raise ExampleError(f"missing key {key!r} (a prompt/response example needs both)")
        if not isinstance(record[key], str):
            raise ExampleError(f"key {key!r} is {type(record[key]).__name__}, expected a string")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


def parse_preference(record):
    """A decoded preference line {"prompt", "chosen", "rejected"} (three strings) -> (chosen messages, rejected
    messages): the same user turn answered two ways; ExampleError naming what is wrong."""
    if not isinstance(record, dict):
        raise ExampleError(f"expected a JSON object, got {type(record).__name__}")
    for key in PREFERENCE_KEYS:
        if key not in record:
            raise ExampleError(f"missing key {key!r} (a preference pair needs 'prompt', 'chosen' and 'rejected'; "
                               f"keys: {sorted(record)[:10]})")
        if not isinstance(record[key], str):
            raise ExampleError(f"key {key!r} is {type(record[key]).__name__}, expected a string")
    return tuple([{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record[key]}]
                 for key in ("chosen", "rejected"))


def checked_messages(messages, for_generation=False):
    """messages as plain {"role", "content"} dicts; ExampleError naming the first bad one. A training example ends
    with an assistant's answer; a generation prompt (for_generation: a chat request) ends with anything else."""
    if not isinstance(messages, list) or not messages:
        raise ExampleError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ExampleError(f"{where} must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise ExampleError(f"{where} has role {message['role']!r}: expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise ExampleError(f"{where} content is {type(message['content']).__name__}, expected a string")
        if message["role"] == "system" and number > 0:
            raise ExampleError(f"{where} is a system message: only the first message may be one")
    if for_generation and messages[-1]["role"] == "assistant":
        raise ExampleError("the last message is an assistant's: a chat request ends with a user (or system) "
                           "message, which the answer follows")
    if not for_generation and messages[-1]["role"] != "assistant":
        raise ExampleError(f"the last message is a {messages[-1]['role']}'s: a conversation must end with an "
                           "assistant answer (text after it would have no loss)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _segments(messages, template):
    """(text, loss mask value, end-of-text after it) per piece, in order."""
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant":
            yield template.assistant_prefix, 0, False
            yield template.response_prefix + content, 1, True
        else:
            yield (template.system_prefix if role == "system" else template.user_prefix) + content, 0, False


def encode_example(messages, tokenizer, template):
    """(ids, mask): lists of ints of equal length; mask 1 on every answer's tokens and its end-of-text."""
    ids, mask = [], []
    for text, value, end_of_text in _segments(messages, template):
        piece = tokenizer.tokenize(text) if text else []
        if end_of_text:
            piece = piece + [tokenizer.eod]
        ids.extend(piece)
        mask.extend([value] * len(piece))
    return ids, mask


def encode_prompt(messages, tokenizer, template):
    """The ids that ask for the next answer: the conversation so far (complete assistant turns included), then the
    template's assistant prefix (" Assistant:")."""
    if messages and messages[-1]["role"] == "assistant":
        raise ValueError("a generation prompt ends with a user (or system) message, not an assistant's")
    ids, _ = encode_example(messages, tokenizer, template)
    return ids + tokenizer.tokenize(template.assistant_prefix)


def truncate_example(ids, mask, max_tokens):
    """The first max_tokens tokens (the whole example when it fits)."""
    return ids[:max_tokens], mask[:max_tokens]


def pack_examples(lengths, capacity):
    """Groups of consecutive example indices whose lengths sum to at most `capacity` (next-fit, in order: an example
    starts a new row when it does not fit the current one; one longer than capacity gets a row of its own and is
    cut there). E.g. lengths [3, 4, 2, 5], capacity 7 -> [[0, 1], [2, 3]]."""
    packs, current, used = [], [], 0
    for index, length in enumerate(lengths):
        length = min(int(length), capacity)
        if current and used + length > capacity:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        packs.append(current)
    return packs


def assemble_row(examples, capacity, pad_id, train_on_prompt=False):
    """One training row of `capacity` (= seq_length + 1) tokens from [(ids, mask), ...], as int64 arrays:

    text       the examples' ids back to back (each cut to capacity), then pad_id
    loss_mask  1 where text[t] is a target (predicted from text[:t] of its own example): the stored mask, or with
               train_on_prompt every token (DeepSpeed-Chat's step 1); always 0 at an example's first token (nothing
               of that example precedes it) and on padding
    segments   1, 2, ... for the first, second, ... example; 0 on padding

    E.g. examples ([5, 6, 7], [0, 1, 1]) and ([8, 9], [0, 1]), capacity 7, pad 0:
    text [5, 6, 7, 8, 9, 0, 0], loss_mask [0, 1, 1, 0, 1, 0, 0], segments [1, 1, 1, 2, 2, 0, 0]."""
    text = np.full(capacity, pad_id, dtype=np.int64)
    loss_mask = np.zeros(capacity, dtype=np.int64)
    segments = np.zeros(capacity, dtype=np.int64)
    start = 0
    for number, (ids, mask) in enumerate(examples, 1):
        length = min(len(ids), capacity - start)
        if length <= 0:
            raise ValueError(f"examples of {sum(len(i) for i, _ in examples)} tokens do not fit a row of {capacity}")
        end = start + length
        text[start:end] = np.asarray(ids[:length])
        loss_mask[start:end] = 1 if train_on_prompt else np.asarray(mask[:length])
        loss_mask[start] = 0
        segments[start:end] = number
        start = end
    return {"text": text, "loss_mask": loss_mask, "segments": segments}
