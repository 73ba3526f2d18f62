"""Generation from the model being trained (DeepSpeed's Hybrid Engine), between training steps, one call for both
paths:

    new_tokens = generate_from_training_model(engine, prompts, 20, greedy=True)   # the ZeRO engine, any stage
    new_tokens = generate_from_training_model(model, prompts, 20, greedy=True)    # the Megatron path's model

It runs the KV-cache `generate` (generation.py) on the unwrapped module in eval mode and restores every
submodule's training flag and every RNG state after (python, numpy, torch, CUDA, the model-parallel tracker:
megatron.checkpoint.preserved_rng_state, which everything built or run for sampling or scoring uses), so training
after interleaved calls is bitwise what it is without them. On the ZeRO engine it decodes inside
engine.gathered_for_inference(): stage 3 gathers every parameter once per call, no gather per token, and
releases them after. (A method engine.generate would make megatron.zero import this package, which imports
megatron.model, which imports megatron.zero: tests/test_layout.py refuses the circle.)

LoRA adapters are not merged into the base weights: the unmerged forward is exact, and merging then unmerging
(W + s B A - s B A) would not give W back bitwise. Data-parallel ranks may pass different prompts and lengths: the
only collectives inside are the model-parallel ones (every rank of a model-parallel group passes the same prompts);
every data-parallel rank calls it (stage 3's gather is collective).
"""
import contextlib

from megatron.checkpoint.rng import preserved_rng_state

from .generation import _unwrap, generate


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


def generate_from_training_model(model, prompts_token_ids, max_new_tokens, **sampling):
    """`generate` on the training model: the ZeRO engine (inside its gathered_for_inference()) or any wrapper of
    the Megatron path's (the module inside runs, so a wrapper's forward, e.g. torch DDP's buffer broadcast, is
    never called); its modes and the RNG states are left as they were."""
    gathered = getattr(model, "gathered_for_inference", contextlib.nullcontext)
    module = _unwrap(model)
    with gathered(), generation_mode(module):
        return generate(module, prompts_token_ids, max_new_tokens, **sampling)
