"""What a training step writes, counted at the dispatcher (issue 54 item 2): per transformer layer and per step,
the elementwise/reduction passes over activation-sized tensors, the matmuls, and the bytes written by dtype casts and
by same-dtype copies, in fp32 and bf16. The numbers are pinned so that a regression (an extra `.float()` round trip
of the activations, a `.contiguous()` copy, a bias added in a pass of its own, a second fp32 copy of the gradients in
the optimizer step) shows on a CPU.

The counts are the eager path's on the CPU. On CUDA two of its pieces are single kernels that are several passes
here (dropout: bernoulli_, div_, mul on the CPU; CUDA's native_dropout is one), and the default there is the fused
(compiled) path, whose kernels the dispatcher does not see; the casts and copies are the same on both devices.

Counting: an op that writes into one of its arguments (add_, copy_) writes that argument; an op that returns a view
of an input (view, t, transpose, split) writes nothing and is not counted; any other op writes its outputs. A pass
over activations is an op, not a matmul, whose largest tensor has at least b x s x h elements (every weight here is
smaller); a cast is an op whose floating output dtype differs from its first floating input's."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.spawn import run_distributed

B, S, H, HEADS, V = 4, 64, 32, 4, 64          # b s h = 8,192 elements; the largest weight 4 h^2 = V h = 4,096
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "embedding", "embedding_dense_backward",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
COPIES = {"copy_", "_to_copy", "clone", "cat", "contiguous", "_foreach_copy_"}
NOT_WRITING = {"_unsafe_view", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}   # a view;
# memory handed out unwritten


class StepCounter(TorchDispatchMode):
    """passes: ops over activation-sized tensors; matmuls; cast_bytes / copy_bytes: bytes written by dtype casts /
    same-dtype copies, of any size; ops: Counter of (op name, numel) for the passes (printed when a pin fails)."""

    def __init__(self, activation_numel):
        super().__init__()
        self.activation_numel = activation_numel
        self.passes, self.matmuls, self.cast_bytes, self.copy_bytes = 0, 0, 0, 0
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        mutated = [a for a, arg in zip(schema.arguments, args) if a.alias_info is not None and a.alias_info.is_write]
        if mutated:
            written = [arg for a, arg in zip(schema.arguments, args)
                       if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, torch.Tensor)]
        elif any(r.alias_info is not None for r in schema.returns) or func.overloadpacket.__name__ in NOT_WRITING:
            return out                                               # a view: nothing written
        else:
            written = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        nbytes = sum(t.numel() * t.element_size() for t in written)
        source = next((t.dtype for t in inputs if t.is_floating_point() and not any(t is w for w in written)), None)
        target = next((t.dtype for t in written if t.is_floating_point()), None)
        if source is not None and target is not None and source != target:
            self.cast_bytes += nbytes
        elif name in COPIES:
            self.copy_bytes += nbytes
        if name in MATMULS:
            self.matmuls += 1
        elif max((t.numel() for t in inputs + written), default=0) >= self.activation_numel:
            self.passes += 1
            self.ops[name] += 1
        return out

    def totals(self):
        return {"passes": self.passes, "matmuls": self.matmuls, "cast_bytes": self.cast_bytes,
                "copy_bytes": self.copy_bytes}


def _model(layers, dtype, fused=False):
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    torch.manual_seed(0)
    return GPT2Model(GPT2ModelConfig(num_layers=layers, vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                                     max_sequence_length=S, attention_dropout=0.0, hidden_dropout=0.1,
                                     embedding_dropout=0.1,
                                     fused_compute=fused)).to(dtype)


def _forward_backward_counts(dtype_name):
    """{layers: totals} of one forward + backward (loss: the mean token loss) at 2 and 3 layers."""
    dtype = getattr(torch, dtype_name)
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    out = {}
    for layers in (2, 3):
        model = _model(layers, dtype)
        model(tokens, labels=tokens)                                # warm-up: lazily built buffers
        with StepCounter(B * S * H) as counter:
            model(tokens, labels=tokens).float().mean().backward()
        out[layers] = counter.totals() | {"ops": dict(counter.ops)}
    return out


@pytest.fixture(scope="module")
def layer_counts():
    return {dtype: run_distributed(_forward_backward_counts, 1, args=(dtype,), model_parallel_size=1)[0]
            for dtype in ("float32", "bfloat16")}


def _per_layer(counts, key):
    return counts[3][key] - counts[2][key]


def _ops_per_layer(counts):
    """{op: calls} that one more layer adds (the 3-layer run minus the 2-layer one), zeros left out."""
    names = set(counts[3]["ops"]) | set(counts[2]["ops"])
    deltas = {name: counts[3]["ops"].get(name, 0) - counts[2]["ops"].get(name, 0) for name in names}
    return {name: n for name, n in deltas.items() if n}


def _rest(counts, key):
    """What is not in the layers: embeddings, final LayerNorm, LM head, loss (the 2-layer run minus 2 layers)."""
    return counts[2][key] - 2 * _per_layer(counts, key)


# One layer's forward + backward, eager, by op (the same in fp32 and bf16):
PER_LAYER_OPS = {
    "add": 6,                    # forward: the 2 row-parallel biases (added after the all-reduce), 2 residual adds;
                                 # backward: the residual stream's gradient summed at the 2 branches
    "native_layer_norm": 2, "native_layer_norm_backward": 2,
    "bernoulli_": 2, "div_": 2,  # the 2 hidden dropouts' masks (bernoulli_, scaled by 1/(1-p))
    "mul": 4,                    # the masks applied, forward and backward
    "gelu": 1, "gelu_backward": 1,
    "sum": 4,                    # the bias gradients of qkv, dense, fc1, fc2
    "cat": 1,                    # q, k and v's gradients joined (the backward of the qkv split)
}
# Outside the layers (eager, the CPU's unchunked loss):
REST_OPS = {
    "add": 1,                                        # word + position embeddings
    "bernoulli_": 1, "div_": 2, "mul": 2,            # the embedding dropout (div_: its scale, and the softmax's)
    "native_layer_norm": 1, "native_layer_norm_backward": 1,   # the final LayerNorm
    "amax": 1, "sub": 1, "gather": 1, "exp_": 1, "sum": 1,      # the loss: max, shift, target logit, exp, sum
    "clone": 1, "scatter_add_": 1, "mul_": 1,        # its backward: softmax copied, - one-hot, x grad_output
}
PER_LAYER_MATMULS = 14           # forward 4 linears + SDPA; backward 2 per linear (input, weight) + SDPA's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_makes_the_pinned_passes_and_no_cast(layer_counts, dtype):
    counts = layer_counts[dtype]
    assert _ops_per_layer(counts) == PER_LAYER_OPS
    assert _per_layer(counts, "passes") == sum(PER_LAYER_OPS.values()) == 25
    assert _per_layer(counts, "matmuls") == PER_LAYER_MATMULS
    assert _per_layer(counts, "cast_bytes") == 0                       # bf16 stays bf16 through the layer
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert _per_layer(counts, "copy_bytes") == 3 * B * S * H * element  # the qkv gradient's cat, nothing else


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loss_casts_the_logits_once_each_way(layer_counts, dtype):
    """Outside the layers only the loss casts: bf16 logits to one fp32 copy, its gradient back to bf16 (the CPU's
    unchunked loss; the chunked GPU loss casts per chunk, the same bytes in all). fp32: no cast at all."""
    counts = layer_counts[dtype]
    logits = B * S * V
    assert _rest(counts, "cast_bytes") == (logits * (4 + 2) if dtype == "bfloat16" else 0)
    per_layer = _ops_per_layer(counts)
    rest = {name: n - 2 * per_layer.get(name, 0) for name, n in counts[2]["ops"].items()}
    assert {name: n for name, n in rest.items() if n} == REST_OPS | ({"_to_copy": 2} if dtype == "bfloat16" else {})


def _optimizer_step_counts(stage):
    """(parameters, totals of engine.backward, totals of engine.step) of a bf16 ZeRO engine at dp 1, second step."""
    from megatron import zero
    model = _model(2, torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": B, "bf16": {"enabled": True}, "steps_per_print": 10 ** 6,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(tokens, labels=tokens).float().mean()
        with StepCounter(B * S * H) as backward:
            engine.backward(loss)
        with StepCounter(B * S * H) as step:
            engine.step()
    return parameters, backward.totals(), step.totals()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_bf16_optimizer_step_casts_the_gradients_and_the_weights_once(stage):
    """engine.step() in bf16 writes exactly 6 bytes per parameter in casts: the fp32 copy of each gradient for the
    masters (4) and the updated masters into the bf16 weights (2); no other copy. (A second fp32 copy of the
    gradients for the norm, .float() before the squares, was 4 more: removed.) The backward copies the gradients
    into ZeRO-2's and ZeRO-3's buckets (2 bytes per parameter), nothing at stages 0 and 1, and casts only the loss's
    gradient. ZeRO-3 at data-parallel 1 copies no weights (resident: nothing gathered, nothing refreshed)."""
    parameters, backward, step = run_distributed(_optimizer_step_counts, 1, args=(stage,), model_parallel_size=1)[0]
    assert 6 * parameters <= step["cast_bytes"] <= 6 * parameters + 16, (step, parameters)   # + a scalar or two
    assert step["copy_bytes"] <= 64, step                             # a few scalars (the norm's sums)
    assert backward["cast_bytes"] == B * S * V * 2                   # the loss's gradient, fp32 to the bf16 logits
    model_copies = 2 * 3 * B * S * H * 2 + B * S * V * 4 + B * S * 4   # 2 qkv cats; the loss's softmax clone and mask
    assert backward["copy_bytes"] == model_copies + (2 * parameters if stage >= 2 else 0), (backward, parameters)
