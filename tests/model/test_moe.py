"""The MoE MLP (mpu/moe.py) against a plain-PyTorch reference written from the definitions (a loop over tokens and
experts): outputs, every gradient, the aux and z losses and their gradient, tokens per expert, for the softmax and
sigmoid routers, top-1 and top-2, GeLU and SwiGLU experts, dropless and with a capacity that drops tokens. And the
model wiring: every --moe-layer-freq-th layer is an MoE layer, and the weights a dense layer draws are the same
with or without MoE in the other layers."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.spawn import run_distributed

HIDDEN, FFN, TOKENS = 8, 12, 12      # 12 tokens: [b=3, s=4]


def reference_moe(x, router, experts, num_experts, topk, router_kind, capacity_factor, swiglu, aux_coeff, z_coeff):
    """(output [T, h], aux + z loss, tokens per expert [E]) by the definitions; experts: [(w_in, b_in, w_out, b_out)]
    full weights (w_in [f or 2f, h] with SwiGLU's gate rows first)."""
    T = x.size(0)
    logits = x @ router.t()
    chosen = []                                # per token: [(expert, weight)]
    probs, ranks = [], []                      # ranks: what the capacity keeps the highest of
    for t in range(T):
        if router_kind == "softmax":
            order = sorted(range(num_experts), key=lambda e: -float(logits[t, e].detach()))[:topk]
            top = torch.stack([logits[t, e] for e in order])
            weights = torch.exp(top - top.max()) / torch.exp(top - top.max()).sum()
            probs.append(torch.softmax(logits[t], dim=0))
            ranks.append(probs[-1])
        else:
            scores = torch.sigmoid(logits[t])
            order = sorted(range(num_experts), key=lambda e: -float(scores[e].detach()))[:topk]
            top = torch.stack([scores[e] for e in order])
            weights = top / top.sum() if topk > 1 else top
            probs.append(scores / scores.sum())
            ranks.append(scores)
        chosen.append(list(zip(order, weights)))
    counts = [sum(1 for t in range(T) for e, _ in chosen[t] if e == expert) for expert in range(num_experts)]
    kept = {(t, e) for t in range(T) for e, _ in chosen[t]}
    if capacity_factor is not None:
        capacity = math.ceil(T * topk * capacity_factor / num_experts)
        kept = set()
        for expert in range(num_experts):
            mine = sorted([(-float(ranks[t][expert].detach()), t) for t in range(T) for e, _ in chosen[t]
                           if e == expert])     # highest score first, the earlier token among equals
            kept |= {(t, expert) for _, t in mine[:capacity]}
    rows = []
    for t in range(T):
        total = torch.zeros_like(x[t])
        for e, w in chosen[t]:
            if (t, e) not in kept:
                continue
            w_in, b_in, w_out, b_out = experts[e]
            hidden = w_in @ x[t] + (b_in if b_in is not None else 0)
            if swiglu:
                gate, up = hidden.chunk(2)
                hidden = gate * torch.sigmoid(gate) * up
            else:
                hidden = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden ** 3)))
            total = total + w * (w_out @ hidden + (b_out if b_out is not None else 0))
        rows.append(total)
    mean_probs = torch.stack(probs).mean(dim=0)
    aux = aux_coeff * num_experts * sum(counts[e] / (T * topk) * mean_probs[e] for e in range(num_experts))
    z = z_coeff * torch.stack([torch.logsumexp(logits[t], dim=0) ** 2 for t in range(T)]).mean()
    return torch.stack(rows), aux + z, counts, T * topk - len(kept)


CASES = [  # (router, topk, capacity factor, swiglu, bias)
    ("softmax", 2, None, False, True),
    ("softmax", 2, 0.5, True, False),     # capacity 3 of 24 assignments over 4 experts: drops
    ("sigmoid", 2, None, True, False),
    ("sigmoid", 1, 1.0, False, True),     # top-1 sigmoid: the score itself is the weight
    ("softmax", 1, 0.75, False, False),
]


def _check_cases():
    """Per case: (max |output diff|, max |grad diff| over x and every weight, |aux diff|, counts equal, assignments
    dropped, max |output|)."""
    import mpu
    results = []
    for router_kind, topk, capacity, swiglu, bias in CASES:
        config = mpu.MoEConfig(num_experts=4, topk=topk, router=router_kind, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                               capacity_factor=capacity)
        torch.manual_seed(0)
        layer = mpu.MoEMLP(HIDDEN, FFN, config, mpu.init_method_normal(0.5), mpu.init_method_normal(0.5),
                           swiglu=swiglu, bias=bias)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
        x = torch.randn(3, 4, HIDDEN).to(mpu.get_device()).requires_grad_(True)   # the layer's device (gpu_check)
        probe = torch.randn(3, 4, HIDDEN).to(mpu.get_device())
        mpu.set_aux_loss_scale(1.0)
        out = layer(x)
        (out * probe).sum().backward()
        aux, counts = layer.last_statistics
        # the reference on copies of the same weights
        x_ref = x.detach().clone().requires_grad_(True)
        router = layer.router.weight.detach().clone().requires_grad_(True)
        experts = []
        for expert in layer.experts:
            fc1, fc2 = expert.dense_h_to_4h, expert.dense_4h_to_h
            experts.append(tuple(None if t is None else t.detach().clone().requires_grad_(True)
                                 for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)))
        ref_out, ref_aux, ref_counts, dropped = reference_moe(x_ref.view(-1, HIDDEN), router, experts, 4, topk, router_kind,
                                                     capacity, swiglu, 0.1, 0.01)
        ((ref_out * probe.view(-1, HIDDEN)).sum() + ref_aux).backward()
        ours = [x.grad, layer.router.weight.grad] + [t.grad for e in layer.experts for t in
                                                     (e.dense_h_to_4h.weight, e.dense_h_to_4h.bias,
                                                      e.dense_4h_to_h.weight, e.dense_4h_to_h.bias) if t is not None]
        theirs = [x_ref.grad, router.grad] + [t.grad for e in experts for t in e if t is not None]
        assert all(a is not None for a in ours)          # an expert without tokens has a zero gradient, not None
        grad_diff = max(float((a - (b if b is not None else 0)).abs().max()) for a, b in zip(ours, theirs))
        results.append((float((out.view(-1, HIDDEN) - ref_out).abs().max()), grad_diff,
                        abs(float(aux) - float(ref_aux)), counts.tolist() == ref_counts, dropped,
                        float(ref_out.abs().max())))
    return results


def test_moe_mlp_matches_the_definitions():
    results = run_distributed(_check_cases, 1, model_parallel_size=1)[0]
    for case, (out_diff, grad_diff, aux_diff, counts_equal, dropped, scale) in zip(CASES, results):
        assert scale > 0.1, case
        assert out_diff <= 1e-5 and grad_diff <= 1e-5 and aux_diff <= 1e-6, (case, out_diff, grad_diff, aux_diff)
        assert counts_equal, case
        if case[2] is None:
            assert dropped == 0, case
        elif case[2] < 1.0:
            assert dropped > 0, case      # the capacity is exercised


def _model_layout():
    """(MLP class per layer at --moe-layer-freq 2; whether the dense layer's and the embeddings' weights equal the
    dense model's of the same seed; the expert parameters' names)."""
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    base = dict(num_layers=3, vocab_size=32, hidden_size=HIDDEN, num_attention_heads=2, max_sequence_length=8)
    torch.manual_seed(5)
    moe = GPT2Model(GPT2ModelConfig(**base, moe=mpu.MoEConfig(num_experts=4, layer_freq=2)))
    torch.manual_seed(5)
    dense = GPT2Model(GPT2ModelConfig(**base))
    kinds = [type(layer.mlp).__name__ for layer in moe.transformer.layers]
    same_first = all(torch.equal(p, dict(dense.named_parameters())[n]) for n, p in moe.named_parameters()
                     if n.startswith(("word_", "position_", "transformer.layers.0.attention")))
    expert_names = sorted(n for n, p in moe.named_parameters() if mpu.is_expert_parameter(p))
    return kinds, same_first, expert_names


def test_moe_layer_frequency_and_names():
    kinds, same_first, expert_names = run_distributed(_model_layout, 1, model_parallel_size=1)[0]
    assert kinds == ["MoEMLP", "ParallelMLP", "MoEMLP"]
    assert same_first
    assert len(expert_names) == 2 * 4 * 4 and "transformer.layers.2.mlp.experts.3.dense_4h_to_h.bias" in expert_names


def _scatter_adds_of_forward_and_backward(topk, capacity):
    """Every op of one MoE forward and backward that adds values into places (index_add, scatter_add, an
    accumulating index_put): (op, whether two of its values land in one place)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    import mpu

    class Adds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in ("index_add", "index_add_", "scatter_add", "scatter_add_", "index_reduce"):
                self.seen.append((name, True))
            elif name in ("index_put", "index_put_", "_index_put_impl_") and \
                    (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
                places = torch.stack([i.reshape(-1) for i in args[1] if i is not None], dim=1)
                self.seen.append((name, places.unique(dim=0).size(0) < places.size(0)))
            return func(*args, **kwargs)

    config = mpu.MoEConfig(num_experts=4, topk=topk, capacity_factor=capacity)
    torch.manual_seed(0)
    layer = mpu.MoEMLP(HIDDEN, FFN, config, mpu.init_method_normal(0.5), mpu.init_method_normal(0.5))
    x = torch.randn(3, 4, HIDDEN).to(mpu.get_device()).requires_grad_(True)
    with Adds() as adds:
        layer(x).square().sum().backward()
    return adds.seen


@pytest.mark.parametrize("topk, capacity", [(2, None), (3, 1.0)])
def test_no_two_rows_are_added_into_one_place(topk, capacity):
    """The combine (each token's k expert outputs) and the dispatch gather's backward (a token's gradient from its
    k rows) sum in a fixed order: no op adds two values into one place, which CUDA does with atomics in the order
    its threads arrive (index_add, or a plain gather's backward). Dropless top-2 and dropping top-3."""
    seen = run_distributed(_scatter_adds_of_forward_and_backward, 1, args=(topk, capacity), model_parallel_size=1)[0]
    assert not [name for name, collides in seen if collides], seen
