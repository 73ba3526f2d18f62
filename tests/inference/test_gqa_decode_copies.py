"""Grouped-query attention decodes without copying its keys/values: in generate's one-token static steps no op
writes a new cache-sized tensor (counted at the dispatcher, under a TorchDispatchMode: a repeat_interleave, an
expand + clone or a cat of the cache would each be one), and the step's grouped attention (each kv head's query
group folded into the query rows) equals plain attention with the keys/values repeated per group, in float64."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.spawn import run_distributed

# 8 query heads on 2 key/value heads (group 4), head_dim 16: one layer's key cache (b x 2 x capacity x 16) is
# larger than any other tensor of a step (the scores b x 8 x capacity, the MLP b x 512, the logits b x 64), and a
# repeat of it is 4 times larger
CONFIG = dict(num_layers=2, vocab_size=64, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
              max_sequence_length=32, init_method_std=0.1)
PROMPTS = [[5, 9, 3, 17, 40, 2, 8], [11], [60, 61, 7, 33]]      # left padding: the step's mask differs per row
NEW = 12


class FreshLargeOutputs(TorchDispatchMode):
    """Records (op, shape, bytes) of each op output of at least `min_numel` elements that is a new tensor (its
    storage none of the inputs'), while `counting`: copies, not views or in-place writes into the cache."""

    def __init__(self, min_numel):
        super().__init__()
        self.min_numel, self.counting, self.seen = min_numel, False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            for t in _tensors(out):
                if t.numel() >= self.min_numel and t.untyped_storage().data_ptr() not in inputs:
                    self.seen.append((str(func), tuple(t.shape), t.numel() * t.element_size()))
        return out


def _tensors(tree):
    from torch.utils._pytree import tree_leaves
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _decode_copies():
    """(large fresh outputs of the static steps, number of steps, the grouped step's context and plain attention's
    in float64)."""
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.text_generation import generate
    mpu.model_parallel_cuda_manual_seed(1234)
    model = GPT2Model(GPT2ModelConfig(**CONFIG), parallel_output=False).eval()
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    capacity = max(map(len, PROMPTS)) + NEW
    mode = FreshLargeOutputs(min_numel=len(PROMPTS) * CONFIG["num_key_value_heads"] * capacity * head_dim)
    steps = []

    def mark_static_steps(module, args, kwargs):   # a static step: the cache writes at a device-held slot
        cache = kwargs.get("inference_cache")
        mode.counting = cache is not None and cache.layers[0].position is not None
        steps.extend([1] if mode.counting else [])
    handle = model.register_forward_pre_hook(mark_static_steps, with_kwargs=True)
    try:
        with mode:
            generate(model, PROMPTS, NEW, greedy=True, cuda_graph=False)
    finally:
        handle.remove()
    return mode.seen, len(steps), _grouped_against_repeated(model.transformer.layers[0].attention.double())


def _grouped_against_repeated(attention):
    """One token's attention over 10 cached keys, the rows' masks hiding different slots: the decode path
    (core_attention at past 9) and plain SDPA with each kv head repeated for its query group."""
    import torch.nn.functional as F
    generator = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, keys = 3, 8, 2, 16, 10
    q = torch.randn(b, heads, 1, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, keys, d, generator=generator, dtype=torch.float64) for _ in range(2))
    hidden = torch.zeros(b, 1, 1, keys, dtype=torch.bool)
    hidden[0, ..., 7:] = True            # row 0: slots 7..9 not written yet
    hidden[2, ..., :4] = True            # row 2: left padding
    grouped = attention.core_attention(q, k, v, hidden, past=keys - 1)                  # [b, 1, heads * d]
    group = heads // kv_heads            # query head j uses kv head j // group (HF's repeat_kv)
    plain = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           attn_mask=~hidden)                           # [b, heads, 1, d]
    return grouped, plain.transpose(1, 2).reshape(b, 1, heads * d)


def test_gqa_decode_steps_copy_no_keys_or_values():
    seen, steps, (grouped, plain) = run_distributed(_decode_copies, 1, model_parallel_size=1)[0]
    assert steps == NEW - 1              # every step after the prompt was counted
    assert seen == [], f"cache-sized copies in the decode steps: {seen[:4]} ... {sum(s[2] for s in seen)} bytes"
    assert torch.allclose(grouped, plain, rtol=0, atol=1e-12)
