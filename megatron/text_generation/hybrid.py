"""Generation from the model being trained (DeepSpeed's Hybrid Engine), between training steps, one call for both
paths:

    new_tokens = generate_from_training_model(engine, prompts, 20, greedy=True)   # the ZeRO engine, any stage
    new_tokens = generate_from_training_model(model, prompts, 20, greedy=True)    # the Megatron path's model

It runs the KV-cache `generate` (generation.py) on the unwrapped module in eval mode and restores every
submodule's training flag and every RNG state after (python, numpy, torch, CUDA, the model-parallel tracker:
megatron.checkpoint.preserved_rng_state, which everything built or run for sampling or scoring uses), so training
after interleaved calls is bitwise what it is without them. On the ZeRO engine it decodes inside
engine.gathered_for_inference(): stage 3 gathers every parameter once per call, no gather per token, and
releases them after.

DeepSpeed's call, `engine.generate(input_ids, attention_mask=..., max_length=..., ...)` (megatron/zero/
hybrid_engine.py), reaches it for a GPT2Model through `generate_ids`, which this module registers with the engine
(megatron.zero cannot import this package: it imports megatron.model, which imports megatron.zero).

LoRA adapters are not merged into the base weights: the unmerged forward is exact, and merging then unmerging
(W + s B A - s B A) would not give W back bitwise. Data-parallel ranks may pass different prompts and lengths: the
only collectives inside are the model-parallel ones (every rank of a model-parallel group passes the same prompts)
and, for an MoE model at expert-parallel size > 1, the expert group's (its ranks decode in lockstep: generate);
every data-parallel rank calls it (stage 3's gather is collective).
"""
import contextlib

import torch

from megatron.checkpoint.rng import preserved_rng_state
from megatron.model import GPT2Model
from megatron.zero import register_generator

from .generation import _unwrap, generate

# Hugging Face's GenerationConfig defaults, for what a caller of engine.generate leaves out
HF_DEFAULTS = {"max_length": 20, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


@contextlib.contextmanager
def generation_mode(module):
    """`module` in eval mode for the body; each submodule's training flag and every RNG state restored on exit."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with preserved_rng_state():
            yield
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def inference_view(model):
    """The module inside the training model, whole and in eval mode for the body: the ZeRO engine's (inside its
    gathered_for_inference()) or any wrapper's of the Megatron path (the module inside runs, so a wrapper's
    forward, e.g. torch DDP's buffer broadcast, is never called); its modes and the RNG states as they were after.
    Generation and the in-training lm-eval tasks (megatron/trainer/downstream_eval.py) read the model through it."""
    gathered = getattr(model, "gathered_for_inference", contextlib.nullcontext)
    module = _unwrap(model)
    with gathered(), generation_mode(module):
        yield module


def generate_from_training_model(model, prompts_token_ids, max_new_tokens, **sampling):
    """`generate` on the training model (the ZeRO engine or a wrapper of the Megatron path's), through
    inference_view."""
    with inference_view(model) as module:
        return generate(module, prompts_token_ids, max_new_tokens, **sampling)


def generate_ids(engine, input_ids, attention_mask=None, max_length=None, max_new_tokens=None, do_sample=None,
                 pad_token_id=None, synced_gpus=False, eos_token_id=None, temperature=None, top_k=None, top_p=None,
                 use_cache=True):
    """`engine.generate` for a GPT2Model (Hugging Face's call and result, generate_from_training_model's decoding):
    input_ids [b, s] left-padded prompts, a row's prompt where attention_mask is 1 (without a mask: the ids that
    are not pad_token_id when it is given and differs from eos_token_id, else all, as Hugging Face infers it).
    max_new_tokens, else max_length - s new tokens; Hugging Face's defaults (max_length 20; sampling top_k 50,
    temperature 1) for what is left out; greedy unless do_sample. Returns a LongTensor [b, s + n]: input_ids, then
    each row's new ids, a row that ended (eos_token_id) or ran out of positions padded with pad_token_id (else
    eos_token_id, else 0); n is the longest row's. Sampling seeds its generator from torch's CPU generator (the
    engine's sampling stream). `synced_gpus` is accepted: generate keeps the ranks that must be in lockstep so."""
    if attention_mask is None:
        infer = pad_token_id is not None and pad_token_id != eos_token_id and bool((input_ids == pad_token_id).any())
        attention_mask = input_ids.ne(pad_token_id) if infer else torch.ones_like(input_ids)
    width = input_ids.shape[1]
    new = max_new_tokens if max_new_tokens is not None else (max_length or HF_DEFAULTS["max_length"]) - width
    if new < 1:
        raise ValueError(f"engine.generate: no new token to produce: max_length ({max_length}) <= the prompts' "
                         f"width ({width}); give max_new_tokens or a larger max_length")
    if isinstance(eos_token_id, (list, tuple)):
        if len(eos_token_id) != 1:
            raise ValueError(f"engine.generate on a GPT2Model takes one eos_token_id, got {eos_token_id}")
        eos_token_id = eos_token_id[0]
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    sampling = {"greedy": True}
    if do_sample:
        sampling = {"greedy": False, "seed": int(torch.randint(0, 2 ** 62, (1,)).item()),
                    "temperature": HF_DEFAULTS["temperature"] if temperature is None else temperature,
                    "top_k": HF_DEFAULTS["top_k"] if top_k is None else top_k,
                    "top_p": HF_DEFAULTS["top_p"] if top_p is None else top_p}
    rows = generate_from_training_model(engine, prompts, new, eod_id=eos_token_id, use_cache=use_cache, **sampling)
    pad = next((t for t in (pad_token_id, eos_token_id) if t is not None), 0)
    out = torch.full((input_ids.shape[0], width + max(map(len, rows))), pad, dtype=torch.long,
                     device=input_ids.device)
    out[:, :width] = input_ids
    for index, row in enumerate(rows):
        out[index, width:width + len(row)] = torch.tensor(row, dtype=torch.long)
    return out


register_generator(GPT2Model, generate_ids)
