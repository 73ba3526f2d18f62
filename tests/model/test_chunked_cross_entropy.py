"""The chunked vocab-parallel loss (mpu/cross_entropy.py) against torch's cross entropy on the gathered full logits,
at mp 1 and mp 2 (gloo), fp32 and bf16, at the chunk sizes where a boundary bug shows (1 token, one that does not
divide the 21 tokens, exactly 21, more than 21), with targets at the first and last vocabulary id of each rank and
a padded vocabulary; and a dispatch counter pinning how many logits-sized fp32 tensors forward + backward write."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.spawn import run_distributed

TOKENS = (3, 7)          # [b, s]: 21 tokens, odd
CHUNKS = (1, 4, 21, 64, None)   # None: the default (every token in one chunk at these widths)
CASES = {"uneven 19": (19, None, None), "padded 37 of 48": (48, 37, 48)}   # vocab, real_vocab_size, vocab_size


def _case_inputs(vocab, real, dtype, world):
    """Full logits [3, 7, vocab] in `dtype`, targets with the first and last real id of every rank's slice, and a
    grad_output; drawn alike on every rank."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(*TOKENS, vocab, generator=generator) * 4).to(dtype)
    real = real or vocab
    target = torch.randint(0, real, TOKENS, generator=generator)
    starts = [piece[0].item() for piece in torch.tensor_split(torch.arange(vocab), world)]
    ends = [piece[-1].item() for piece in torch.tensor_split(torch.arange(vocab), world)]
    edges = sorted({i for i in starts + ends + [real - 1] if i < real})
    target.view(-1)[:len(edges)] = torch.tensor(edges)
    target[-1, -1] = real - 1                                 # the last real id in the last token (last chunk)
    return logits, target, torch.rand(TOKENS, generator=generator)


def _losses_against_torch(dtypes):
    """{(case, dtype, chunk): (loss error relative to max(1, loss), grad error, padded grad max, input changed)} on
    this rank, against torch's cross entropy over the first real_vocab_size logits, in fp64 from the same
    (bf16-rounded) values. Drawn on the CPU, run on mpu's device."""
    import mpu
    rank, world, device = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), mpu.get_device()
    out = {}
    for case, (vocab, real, vocab_size) in CASES.items():
        for dtype in dtypes:
            logits, target, grad_output = _case_inputs(vocab, real, dtype, world)
            reference = logits[..., :real or vocab].double().requires_grad_()
            expected = F.cross_entropy(reference.reshape(-1, reference.size(-1)), target.view(-1), reduction="none")
            expected.view(TOKENS).backward(grad_output.double())
            expected_grad = torch.cat([reference.grad, torch.zeros(*TOKENS, vocab - reference.size(-1))], -1)
            mine_expected = torch.tensor_split(expected_grad, world, dim=-1)[rank]
            for chunk in CHUNKS:
                mine = torch.tensor_split(logits, world, dim=-1)[rank].to(device).requires_grad_()
                before = mine.detach().clone()
                loss = mpu.vocab_parallel_cross_entropy(mine, target.to(device), real_vocab_size=real,
                                                        vocab_size=vocab_size, chunk_tokens=chunk)
                loss.backward(grad_output.to(device))
                assert loss.dtype == torch.float32 and mine.grad.dtype == dtype
                padded = mine.grad[..., max(0, (real or vocab) - rank * mine.size(-1)):]   # even split when padded
                relative = (loss.double().cpu() - expected.view(TOKENS)).abs() / expected.view(TOKENS).clamp(min=1)
                out[case, dtype, chunk] = (relative.max().item(),
                                           (mine.grad.double().cpu() - mine_expected).abs().max().item(),
                                           padded.abs().max().item() if padded.numel() else 0.0,
                                           (mine.detach() - before).abs().max().item())
    return out


@pytest.mark.parametrize("model_parallel_size", [1, 2])
def test_chunked_loss_equals_torch_cross_entropy(model_parallel_size):
    """fp32: loss (relative to max(1, loss)) and gradient within 1e-6 of torch's (fp64 on the same values); bf16: the
    loss too (fp32 accumulation inside; a bf16 sum is off by ~4e-3), the bf16 gradient within its rounding (2^-8
    of its largest value, 1 here); the padded columns' gradient exactly 0; the logits unchanged."""
    dtypes = (torch.float32, torch.bfloat16)
    ranks = run_distributed(_losses_against_torch, model_parallel_size, args=(dtypes,),
                            model_parallel_size=model_parallel_size)
    for rank, result in enumerate(ranks):
        assert len(result) == len(CASES) * len(dtypes) * len(CHUNKS)
        for (case, dtype, chunk), (loss_error, grad_error, padded, changed) in result.items():
            where = f"rank {rank} {case} {dtype} chunk {chunk}"
            assert loss_error <= 1e-6, (where, loss_error)       # relative to max(1, loss): losses reach ~15
            assert grad_error <= (1e-6 if dtype == torch.float32 else 2 ** -8), (where, grad_error)
            assert padded == 0.0 and changed == 0.0, where


# ------------------------------------------------------------------------------------------ the dispatch counter
class _WriteCounter(TorchDispatchMode):
    """Every aten op's output tensors (an in-place op's: the tensor it wrote): (op, dtype, elements); a scatter
    writes as many elements as its source. Allocations (empty*) and views write nothing and are left out."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith(("empty", "new_empty")):
            outputs, _ = tree_flatten(result)
            if name.startswith("scatter"):
                outputs = [args[3].expand_as(args[2]) if isinstance(args[3], torch.Tensor) else args[2]]
            self.writes += [(name, t.dtype, t.numel()) for t in outputs if isinstance(t, torch.Tensor)]
        return result


def _count_writes(shape, dtype, chunk):
    import mpu
    torch.manual_seed(0)
    logits = torch.randn(*shape, dtype=dtype).requires_grad_()
    target = torch.randint(0, shape[-1], shape[:-1])
    with _WriteCounter() as counter:
        mpu.vocab_parallel_cross_entropy(logits, target, chunk_tokens=chunk).sum().backward()
    full = logits.numel()
    return {"full fp32": sorted(n for n, d, e in counter.writes if d == torch.float32 and e >= full),
            "largest fp32": max(e for n, d, e in counter.writes if d == torch.float32),
            "bytes per logit": sum(e * (2 if d == torch.bfloat16 else 4) for n, d, e in counter.writes if
                                   d in (torch.float32, torch.bfloat16)) / full,
            "full bf16": sorted(n for n, d, e in counter.writes if d == torch.bfloat16 and e >= full)}


def _counts():
    import mpu
    return {"device": mpu.get_device().type,"bf16 chunk 5": _count_writes((4, 9, 64), torch.bfloat16, 5),
            "bf16 one chunk": _count_writes((4, 9, 64), torch.bfloat16, 36),
            "fp32 chunk 5": _count_writes((4, 9, 64), torch.float32, 5),
            "bf16 default": _count_writes((4, 9, 64), torch.bfloat16, None)}


def test_loss_writes_no_logits_sized_fp32_tensor():
    """36 tokens x 64 logits, chunks of 5 tokens, bf16 logits in: forward + backward write no fp32 tensor of the
    logits' size (the unchunked loss before it wrote six: the upcast, the shifted logits, their exp, the softmax,
    its clone, the grad_output multiply; 26.8 bytes per logit) and none larger than a chunk; even the bf16 gradient
    is written chunk by chunk. Bytes written per logit: fp32 scratch forward sub + exp (8), backward sub + exp +
    multiply (12), the bf16 gradient (2), plus a few numbers per token. With one chunk of every token the same
    passes are logits-sized (the counter sees them); at fp32 the gradient is fp32, written chunk by chunk too."""
    counts = run_distributed(_counts, 1, model_parallel_size=1)[0]
    bf16 = counts["bf16 chunk 5"]
    assert bf16["full fp32"] == [] and bf16["full bf16"] == [], bf16
    assert bf16["largest fp32"] == 5 * 64
    assert 22 <= bf16["bytes per logit"] <= 23.5, bf16      # + per-token numbers (36 tokens in 2304 logits)
    one_chunk = counts["bf16 one chunk"]
    assert one_chunk["full fp32"] == ["exp_", "exp_", "mul_", "sub", "sub"], one_chunk
    assert one_chunk["bytes per logit"] == bf16["bytes per logit"]
    fp32 = counts["fp32 chunk 5"]
    assert fp32["full fp32"] == [] and fp32["largest fp32"] == 5 * 64, fp32
    if counts["device"] == "cpu":    # the CPU default is the unchunked loss (its logits-sized fp32 upcast and softmax)
        assert "_to_copy" in counts["bf16 default"]["full fp32"], counts["bf16 default"]   # the whole upcast


def test_default_chunk_by_device():
    """A GPU's chunk: 2^24 logits (333 tokens of GPT-2's padded 50304); a CPU's: 2^21 (256 tokens at 8192); always at
    least one token; a device type not named gets the GPU's."""
    from mpu.cross_entropy import default_chunk_tokens
    assert default_chunk_tokens(50304, "cuda") == 333 and default_chunk_tokens(50304, "xpu") == 333
    assert default_chunk_tokens(8192, "cpu") == 256
    assert default_chunk_tokens(2 ** 25, "cuda") == 1 and default_chunk_tokens(2 ** 22, "cpu") == 1
