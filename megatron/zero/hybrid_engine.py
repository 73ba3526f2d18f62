"""DeepSpeed's Hybrid Engine: `engine.generate(...)` decodes with the weights being trained, between training steps.

    seq = engine.generate(prompts, attention_mask=mask, max_length=prompts.shape[1] + 256,
                          pad_token_id=tokenizer.pad_token_id, synced_gpus=True)   # DeepSpeed-Chat's call
    seq = engine.module.generate(prompts, ...)    # the same, with "hybrid_engine": {"enabled": true}

One call: the parameters whole once (engine.gathered_for_inference(): ZeRO-3 gathers each buffer once, bypasses
the per-unit hooks, so data-parallel ranks may decode different numbers of steps with other prompts, and releases
everything after, exceptions included), the module in eval mode, its generator, every submodule's training flag
restored. The generator is the module's own `generate` for a Hugging Face causal LM (its KV cache, its
GenerationConfig defaults, its output: a LongTensor of prompt + new ids) or, for a module without one, the function
registered for its class (`register_generator`: megatron.text_generation registers megatron's GPT2Model; this package
cannot import generation itself, megatron.model imports megatron.zero). Every data-parallel rank calls it (the
ZeRO-3 gather is collective).

RNG: training's RNG states (the CPU generator, the device's, mpu's model-parallel tracker) are left exactly as they
were found, also when `do_sample` draws. DeepSpeed does not do this (its sampling advances the global generator, so
training after a sampled call differs); here training with generate calls between its steps is bitwise the
training without them. Sampling draws from the RNG states the call finds (its draws are those of Hugging Face's
`generate` on those states), except when they are the ones the previous call left (nothing drew or seeded in
between): then it continues where that call's draws ended, as back-to-back Hugging Face calls do, so two calls in a
row do not repeat their samples. What it continues from lives in this process only (a checkpoint does not hold
it). A greedy call draws nothing.

`"hybrid_engine": {"enabled": true}` routes the client module's own `generate` here (DeepSpeed's engine sets
`module.generate = engine.generate`): DeepSpeed-Chat calls `actor_model.module.generate(...)`, not the engine's.
Its other keys (max_out_tokens, inference_tp_size, ...) configure DeepSpeed's inference kernels and have no effect
here (config_keys.DEEPSPEED_KEYS says why, at start-up).
"""
import contextlib

import torch

from mpu.random import get_rng_states, set_rng_states

_GENERATORS = []     # (module class, function(engine, input_ids, **hf_style_arguments) -> LongTensor)


def register_generator(module_class, generate):
    """Make `engine.generate(input_ids, attention_mask=..., max_length=..., max_new_tokens=..., do_sample=...,
    pad_token_id=..., synced_gpus=..., **kwargs)` of an engine whose module is a `module_class` call
    `generate(engine, input_ids, ...)` with the same arguments, inside the RNG stream of sampling (the function
    gathers and sets eval mode itself, e.g. through engine.gathered_for_inference()). The latest registration of
    a class wins."""
    _GENERATORS[:] = [(cls, fn) for cls, fn in _GENERATORS if cls is not module_class]
    _GENERATORS.append((module_class, generate))


def _same_states(a, b):
    """Whether two get_rng_states() results are equal (CPU, device, every tracker state)."""
    (cpu_a, device_a, tracker_a), (cpu_b, device_b, tracker_b) = a, b
    return torch.equal(cpu_a, cpu_b) and torch.equal(device_a, device_b) and tracker_a.keys() == tracker_b.keys() \
        and all(torch.equal(tracker_a[name], tracker_b[name]) for name in tracker_a)


def _registered(module):
    for cls, generate in reversed(_GENERATORS):
        if isinstance(module, cls):
            return generate
    return None


@contextlib.contextmanager
def eval_mode(module):
    """`module` in eval mode for the body; each submodule's training flag as it was, after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


class HybridEngine:
    """What one engine keeps for generate: the module's own `generate` (taken before `enabled` reroutes it) and
    the sampling RNG stream."""

    def __init__(self, engine, module, config):
        own = getattr(module, "generate", None)
        self.module_generate = own if callable(own) else None
        self.left = None      # (the RNG states the last call found and left, those its draws ended at)
        if config.enabled and self.module_generate is not None:
            module.generate = engine.generate    # DeepSpeed's reroute (an attribute of this module object only)

    @contextlib.contextmanager
    def sampling_stream(self):
        """The body draws from the RNG states found, or from where the previous call's draws ended when the states
        found are those it left; the states found are put back after."""
        found = get_rng_states()
        if self.left is not None and _same_states(found, self.left[0]):
            set_rng_states(self.left[1])
        try:
            yield
        finally:
            self.left = (found, get_rng_states())
            set_rng_states(found)

    def generate(self, engine, input_ids, attention_mask, max_length, max_new_tokens, do_sample, pad_token_id,
                 synced_gpus, kwargs):
        module = engine.module
        registered = _registered(module) if self.module_generate is None else None
        if self.module_generate is None and registered is None:
            raise TypeError(f"engine.generate: {type(module).__name__} has no generate() of its own (a Hugging Face "
                            "causal LM has) and none is registered for it: for megatron's GPT2Model import "
                            "megatron.text_generation, which registers it (megatron.zero.register_generator)")
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        given = {"attention_mask": attention_mask, "max_length": max_length, "max_new_tokens": max_new_tokens,
                 "do_sample": do_sample, "pad_token_id": pad_token_id}
        with self.sampling_stream():
            if registered is not None:
                return registered(engine, input_ids, **given, synced_gpus=synced_gpus, **kwargs)
            # None: the model's GenerationConfig decides, as when the caller leaves the keyword out
            given = {key: value for key, value in given.items() if value is not None}
            with engine.gathered_for_inference(), eval_mode(module):
                return self.module_generate(input_ids, **given, synced_gpus=synced_gpus, **kwargs)
