"""Rotary position embeddings (RoFormer; the rotate-half convention of Hugging Face's Llama), applied to the
queries and keys of every attention head:

    inv_freq[i] = theta ** (-2i / d)            i = 0 .. d/2 - 1 (d = head dim)
    angle[p, i] = p * inv_freq[i]               cos/sin of [angle, angle]: [b, 1, s, d]
    rotate_half(x) = [-x[d/2:], x[:d/2]]
    x' = x * cos + rotate_half(x) * sin         (x: [b, heads, s, d])

so dimension i is paired with i + d/2 (not 2i with 2i + 1, the interleaved convention of the original paper and of
GPT-NeoX's rotary_pct: checkpoints of the two are not interchangeable without permuting the q/k rows).
The tables depend on positions only: the model computes them once per forward and every layer uses them.
"""
import torch


def rotary_tables(position_ids, head_dim, theta, dtype):
    """(cos, sin), each [b, 1, s, head_dim] in `dtype`, for position_ids [b, s] (computed in fp32 as HF does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                       # [d/2]
    angles = position_ids[..., None].float() * inv_freq                         # [b, s, d/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)                   # [b, 1, s, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)                                          # 2 x [..., d/2]
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x, tables):
    """x [b, heads, s, d] rotated by tables = rotary_tables(...) (positions of these s tokens)."""
    cos, sin = tables
    return x * cos + rotate_half(x) * sin
