"""Batched autoregressive generation with the training GPT2Model, at any model-parallel size.

    new_tokens = generate(model, [[5, 7, 9], [3]], max_new_tokens=20, greedy=True, eod_id=tokenizer.eod)

Padding: prompts are RIGHT-padded into one [b, max_prompt] batch (Megatron's scheme). Decoding starts after the
shortest prompt; at every step a row whose prompt is not yet exhausted takes its next prompt token instead of the
sampled one, so each row is decoded exactly as if it were alone (same positions, no padding masks). With the KV
cache (use_cache=True) the shortest prompt's prefix is run once and each later step feeds one token; with
use_cache=False (--recompute) every step re-runs the whole sequence so far.

Logits are gathered over the vocab-parallel group (when the model keeps them parallel) and cut to the real
vocabulary (config.real_vocab_size), so padded ids are never produced. Model-parallel rank 0 samples with a
torch.Generator seeded by `seed` and broadcasts the ids over the model-parallel group: every rank of a group gets
the same tokens. A row stops after producing `eod_id` (included in its output), after `max_new_tokens`, or at the
end of the position table.
"""
import torch
import torch.distributed as dist

import mpu


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def sample_logits(logits, greedy=False, temperature=1.0, top_k=0, top_p=0.0, generator=None):
    """One token id per row of logits [b, V] (fp32): argmax, or a sample after temperature, top-k and top-p."""
    if greedy:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature} (use greedy for argmax)")
    logits = logits / temperature
    if top_k and top_k > 0:
        top_k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[:, 1:] = remove[:, :-1].clone()   # keep the token that crosses top_p
        remove[:, 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling_options(max_new_tokens, greedy=False, temperature=1.0, top_k=0, top_p=0.0):
    """ValueError (one line, named by the tools' flags) for options that cannot mean anything: before any work."""
    if max_new_tokens < 1:
        raise ValueError(f"--out-seq-length (max_new_tokens) is {max_new_tokens}: give the number of new tokens, "
                         "at least 1")
    if top_k < 0:
        raise ValueError(f"--top_k is {top_k}: give 0 (off) or the number of most likely tokens to sample from")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"--top_p is {top_p}: give a probability mass in (0, 1], e.g. 0.9 (0 turns it off)")
    if not greedy and not temperature > 0:
        raise ValueError(f"--temperature is {temperature}: it must be positive (or pass --greedy for argmax)")


def _broadcast_from_model_parallel_src(tensor):
    if mpu.get_model_parallel_world_size() > 1:
        dist.broadcast(tensor, mpu.get_model_parallel_src_rank(), group=mpu.get_model_parallel_group())
    return tensor


@torch.no_grad()
def generate(model, prompts_token_ids, max_new_tokens, greedy=False, temperature=1.0, top_k=0, top_p=0.0,
             eod_id=None, use_cache=True, seed=1234):
    """Continue each prompt (a list of token ids) by up to max_new_tokens tokens; returns a list of lists of the
    new token ids per prompt (ending with eod_id where it was produced). Every model-parallel rank must call it
    with the same prompts and arguments."""
    check_sampling_options(max_new_tokens, greedy, temperature, top_k, top_p)
    module = _unwrap(model)
    config = module.config
    max_positions = config.max_sequence_length
    real_vocab = config.real_vocab_size or config.vocab_size
    prompts = [list(map(int, p)) for p in prompts_token_ids]
    if not prompts:
        return []
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty: give at least one token (e.g. end-of-document)")
        if len(prompt) > max_positions:
            raise ValueError(f"prompt {index} has {len(prompt)} tokens, longer than the position table "
                             f"(max_sequence_length {max_positions}): shorten it")
        bad = [t for t in prompt if not 0 <= t < real_vocab]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {real_vocab}): {bad[:5]}")
    device = module.word_embeddings.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    batch = len(prompts)
    total = min(int(lengths.max()) + max_new_tokens, max_positions)
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)       # right-padded
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, device=device)
    limit = torch.clamp(lengths + max_new_tokens, max=max_positions)          # end (exclusive) of each row
    done = limit <= lengths
    generator = None
    if mpu.get_model_parallel_rank() == 0 and not greedy:
        generator = torch.Generator(device=device).manual_seed(seed)
    gather = getattr(module, "parallel_output", False) and mpu.get_model_parallel_world_size() > 1
    was_training = model.training
    model.eval()
    try:
        cache = module.new_inference_cache() if use_cache else None
        start = int(lengths.min())
        fed = 0                                         # positions already in the cache
        for position in range(start, total):
            if bool(done.all()):
                break
            if cache is not None:
                logits = model(tokens[:, fed:position], inference_cache=cache)
                fed = position
            else:
                logits = model(tokens[:, :position])
            logits = logits[:, -1, :]                                         # [b, V/p] or [b, V]
            if gather:
                logits = mpu.gather_from_model_parallel_region(logits)
            logits = logits[:, :real_vocab].float()                           # padded ids never sampled
            if mpu.get_model_parallel_rank() == 0:
                new = sample_logits(logits, greedy, temperature, top_k, top_p, generator)
            else:
                new = torch.empty(batch, dtype=torch.long, device=device)
            new = _broadcast_from_model_parallel_src(new.to(torch.long).contiguous())
            in_prompt = position < lengths
            tokens[:, position] = torch.where(in_prompt, tokens[:, position], new)
            generated = ~in_prompt & ~done
            if eod_id is not None:
                done = done | (generated & (new == eod_id))
            done = done | (position + 1 >= limit)
    finally:
        model.train(was_training)
    results = []
    for row, prompt in enumerate(prompts):
        out = tokens[row, len(prompt):int(limit[row])].tolist()
        if eod_id is not None and eod_id in out:
            out = out[:out.index(eod_id) + 1]
        results.append(out)
    return results


def load_inference_model(args):
    """GPT2Model from Megatron's arguments with gathered logits, its weights (only) loaded from args.load at this
    run's model-parallel size (either path, any saving topology), in eval mode: what generation and the zero-shot
    tasks run on. No optimizer, lr-scheduler, counters or RNG are needed or restored."""
    import dataclasses
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.train_state import CheckpointOptions
    from megatron.checkpoint import load_checkpoint
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(f"generation and evaluation need the whole model on one stage, not "
                         f"--pipeline-model-parallel-size {mpu.get_pipeline_model_parallel_world_size()}: run with "
                         "--pipeline-model-parallel-size 1 (a pipelined checkpoint loads there)")
    model = GPT2Model(GPT2ModelConfig.from_args(args), parallel_output=False)
    model.to(device=mpu.get_device(), dtype=getattr(torch, args.params_dtype))
    options = dataclasses.replace(CheckpointOptions.from_args(args), finetune=True, no_load_optim=True,
                                  no_load_rng=True)
    load_checkpoint(model, None, None, options)
    return model.eval()
