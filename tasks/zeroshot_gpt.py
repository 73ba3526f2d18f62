"""Zero-shot GPT-2 evaluation with Megatron's semantics (tasks/zeroshot_gpt/{datasets,evaluate}.py).

WIKITEXT103: the raw file is counted in words, detokenized (tasks/detokenizer.py), tokenized whole. N tokens give
T = N - 1 targets. Windows of seq_length + 1 tokens start every `overlapping_eval` tokens (Megatron's flag is the
stride, i.e. the number of NEW tokens each window scores): window 0 scores all its targets, window k > 0 only its
last overlapping_eval targets, which are exactly the ones no earlier window scored, so every target is scored once
with up to seq_length - overlapping_eval tokens of context. overlapping_eval == seq_length: disjoint windows.
    avg loss = total / T;  ppl = exp(avg loss);  token ratio = T / (W - 1) with W = len(raw.strip().split(" "));
    adjusted ppl = exp(avg loss * token ratio) = exp(total / (W - 1))       (Megatron's "adjusted ppl", unclamped)

LAMBADA ({"text": ...} per line), teacher-forced, one forward pass per example, correct iff every target token is the
argmax (over the real vocabulary) given the context and the earlier target tokens:
    default (Megatron's non-strict): ids = tokenize(text); context = ids[:-1], target = [ids[-1]]: only the LAST BPE
        TOKEN of the text is predicted (a multi-token last word has its other tokens in the context).
    strict (--strict-lambada): word = text.split()[-1]; context = tokenize(text[:text.rfind(word)].strip()),
        target = tokenize(" " + word): every token of the last word, tokenized alone, must be the argmax.
An example longer than seq_length + 1 tokens keeps its last seq_length + 1 (Megatron would fail on it).

Rows are right-padded per batch (causal attention: padding never changes earlier positions), so the batch size does
not change the result. Logits are gathered over the model-parallel group (the model is built with
parallel_output=False) and clamped to the real vocabulary; with data parallelism each data-parallel rank takes every
dp-th row and the sums are all-reduced over the data-parallel group.
"""
import json
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.cli import UserError


class TaskError(UserError, ValueError):
    """Bad input (a flag, a data file): reported as one line, exit status 1."""

import mpu

from tasks.detokenizer import wikitext_detokenize


def wikitext_rows(ids, seq_length, overlapping_eval):
    """[(tokens: up to seq_length + 1 ids, scored: bool per target)] covering every target once."""
    if not 1 <= overlapping_eval <= seq_length:
        raise TaskError(f"--overlapping-eval must be in 1..seq_length ({seq_length}), got {overlapping_eval}")
    targets = len(ids) - 1
    if targets < 1:
        raise TaskError("the validation text tokenizes to fewer than 2 tokens")
    windows = 1 + math.ceil(max(targets - seq_length, 0) / overlapping_eval)
    rows = []
    for k in range(windows):
        start = k * overlapping_eval
        tokens = ids[start:start + seq_length + 1]
        scored = [True] * (len(tokens) - 1)
        if k > 0:  # only the last overlapping_eval positions of the full window are new
            first_new = seq_length - overlapping_eval
            scored = [i >= first_new for i in range(len(scored))]
        rows.append((tokens, scored))
    return rows


def lambada_example(text, tokenizer, strict):
    """(context ids, target ids) under Megatron's rule (module docstring)."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    word = text.split()[-1]
    return tokenizer.tokenize(text[:text.rfind(word)].strip()), tokenizer.tokenize(" " + word)


def lambada_rows(examples, seq_length):
    rows = []
    for context, target in examples:
        tokens = (context + target)[-(seq_length + 1):]
        scored = [False] * (len(tokens) - 1 - len(target)) + [True] * len(target)
        rows.append((tokens, scored))
    return rows


def _batch(rows, pad_id, device):
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    scored = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (ids, mask) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        scored[i, :len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return tokens.to(device), scored.to(device)


@torch.no_grad()
def score_rows(model, rows, batch_size, real_vocab_size, pad_id=0):
    """(summed loss over scored targets, number of rows whose scored targets are all argmax), over all ranks."""
    if batch_size < 1:
        raise TaskError(f"batch size must be >= 1, got {batch_size}")
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    mine = rows[dp_rank::dp_size]
    device = mpu.get_device()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(0, len(mine), batch_size):
        tokens, scored = _batch(mine[start:start + batch_size], pad_id, device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)[..., :real_vocab_size].float()
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        total[0] += (losses.double() * scored).sum()
        correct = (logits.argmax(-1) == labels) | ~scored
        total[1] += correct.all(-1).sum()
    if dp_size > 1:
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
    return total[0].item(), int(total[1].item())


def _exp(x):
    return math.exp(x) if x < 700 else float("inf")


def evaluate_wikitext(model, tokenizer, raw_text, seq_length, overlapping_eval, batch_size, real_vocab_size):
    words = len(raw_text.strip().split(" "))
    ids = tokenizer.tokenize(wikitext_detokenize(raw_text))
    rows = wikitext_rows(ids, seq_length, overlapping_eval)
    total, _ = score_rows(model, rows, batch_size, real_vocab_size, pad_id=tokenizer.eod)
    targets = len(ids) - 1
    loss = total / targets
    ratio = targets / max(words - 1, 1)
    return {"avg_loss": loss, "ppl": _exp(loss), "adjusted_ppl": _exp(loss * ratio), "token_ratio": ratio,
            "tokens": len(ids), "words": words, "windows": len(rows)}


def read_lambada(path):
    texts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    texts.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise TaskError(f"{path}:{number}: not a JSON object with a \"text\" field") from None
    if not texts:
        raise TaskError(f"{path}: no examples")
    return texts


def evaluate_lambada(model, tokenizer, texts, seq_length, strict, batch_size, real_vocab_size):
    examples = [lambada_example(text, tokenizer, strict) for text in texts]
    for number, (context, target) in enumerate(examples, 1):
        if not context or not target:
            raise TaskError(f"LAMBADA example {number} has no context or no last word")
    _, correct = score_rows(model, lambada_rows(examples, seq_length), batch_size, real_vocab_size,
                            pad_id=tokenizer.eod)
    return {"correct": correct, "total": len(examples), "accuracy": correct / len(examples)}


def format_result(task, result):
    """Megatron's result line."""
    if "ppl" in result:
        return (f" validation results on {task} | avg loss: {result['avg_loss']:.6E} | ppl: {result['ppl']:.6E} | "
                f"adjusted ppl: {result['adjusted_ppl']:.6E} | token ratio: {result['token_ratio']} |")
    return (f" validation results on {task} | number correct: {result['correct']} | "
            f"total examples: {result['total']} | avg accuracy: {result['accuracy']:.6E}")
