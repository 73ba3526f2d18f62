"""mpu layers at model-parallel sizes 1, 2 and 4 against single-process torch references (fp32, 1e-6), and the
collectives ZeRO and mpu use, on the run's backend.

Device-agnostic: every tensor lives on mpu's device (the CPU on gloo, the rank's GPU on NCCL under `pytest --device
cuda`), and the references are drawn there too (CPU and CUDA generators give different numbers for one seed).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.spawn import run_distributed

TOL = 1e-6


def _device():
    import mpu
    return mpu.get_device()


def _master(shape, seed, std=0.02):
    """The full-size weight a layer seeded with `seed` draws (on the device: its generator is the layer's)."""
    torch.manual_seed(seed)
    master = torch.empty(shape, device=_device())
    torch.nn.init.normal_(master, std=std)
    return master


def _device_rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _normal(std=0.02):
    return lambda t: torch.nn.init.normal_(t, std=std)


def _gather_last(t):
    """Concatenate every model-parallel rank's tensor along the last dim (test-side, no autograd)."""
    import mpu
    pieces = [torch.empty_like(t) for _ in range(mpu.get_model_parallel_world_size())]
    torch.distributed.all_gather(pieces, t.contiguous(), group=mpu.get_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def _check_layers():
    import mpu
    diffs = {}
    b, s, h, out = 3, 5, 8, 12
    torch.manual_seed(1234)
    x = torch.randn(b, s, h, device=_device(), requires_grad=True)
    # Column-parallel linear, gathered output.
    torch.manual_seed(7)
    column = mpu.ColumnParallelLinear(h, out, gather_output=True, init_method=_normal())
    weight = _master((out, h), 7)
    y = column(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = weight.clone().requires_grad_(True)
    ref_y = F.linear(ref_x, ref_w)
    grad = torch.randn_like(ref_y)
    y.backward(grad)
    ref_y.backward(grad)
    diffs["column_forward"] = (y - ref_y).abs().max().item()
    diffs["column_grad_input"] = (x.grad - ref_x.grad).abs().max().item()
    diffs["column_grad_weight"] = (_gather_last(column.weight.grad.t()).t() - ref_w.grad).abs().max().item()

    # Row-parallel linear, input split inside.
    x.grad = None
    torch.manual_seed(8)
    row = mpu.RowParallelLinear(h, out, input_is_parallel=False, init_method=_normal())
    weight = _master((out, h), 8)
    y = row(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = weight.clone().requires_grad_(True)
    ref_y = F.linear(ref_x, ref_w)
    y.backward(grad)
    ref_y.backward(grad)
    diffs["row_forward"] = (y - ref_y).abs().max().item()
    diffs["row_grad_input"] = (x.grad - ref_x.grad).abs().max().item()
    diffs["row_grad_weight"] = (_gather_last(row.weight.grad) - ref_w.grad).abs().max().item()

    # Vocab-parallel embedding.
    vocab = 16
    torch.manual_seed(9)
    embedding = mpu.VocabParallelEmbedding(vocab, h, init_method=_normal())
    table = _master((vocab, h), 9)
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(3)).to(_device())
    y = embedding(ids)
    ref_table = table.clone().requires_grad_(True)
    ref_y = F.embedding(ids, ref_table)
    grad = torch.randn_like(ref_y)
    y.backward(grad)
    ref_y.backward(grad)
    diffs["embedding_forward"] = (y - ref_y).abs().max().item()
    gathered = _gather_last(embedding.weight.grad.t()).t()
    diffs["embedding_grad"] = (gathered - ref_table.grad).abs().max().item()
    return diffs


def _check_cross_entropy(vocab):
    """Uneven vocabulary split when `vocab` is not divisible: rank r gets torch.tensor_split's r-th piece."""
    import mpu
    device = _device()
    torch.manual_seed(11)
    logits = torch.randn(4, 6, vocab, device=device) * 3
    target = torch.randint(0, vocab, (4, 6), device=device)
    rank, world = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    mine = torch.tensor_split(logits, world, dim=-1)[rank].clone().requires_grad_(True)
    before = mine.detach().clone()
    loss = mpu.vocab_parallel_cross_entropy(mine, target)
    ref_logits = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(4, 6)
    weights = torch.rand(4, 6, device=device)
    (loss * weights).sum().backward()
    (ref_loss * weights).sum().backward()
    ref_grad_mine = torch.tensor_split(ref_logits.grad, world, dim=-1)[rank]
    return {"loss": (loss - ref_loss).abs().max().item(),
            "grad": (mine.grad - ref_grad_mine).abs().max().item(),
            "input_changed": (mine.detach() - before).abs().max().item()}


def _check_clip_grad_norm():
    """A replicated bias plus split weights: our norm and clipping equal torch's on the gathered model."""
    import mpu
    torch.manual_seed(5)
    column = mpu.ColumnParallelLinear(6, 8, gather_output=True, init_method=_normal())
    row = mpu.RowParallelLinear(8, 4, input_is_parallel=False, init_method=_normal())
    x = torch.randn(3, 6, device=_device())
    row(column(x)).pow(2).sum().mul(100).backward()
    full = [_gather_last(column.weight.grad.t()).t(), _gather_last(column.bias.grad), _gather_last(row.weight.grad),
            row.bias.grad.clone()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(ref_params, full):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5).item()
    norm = mpu.clip_grad_norm(list(column.parameters()) + list(row.parameters()), 0.5)
    clipped = [_gather_last(column.weight.grad.t()).t(), _gather_last(column.bias.grad), _gather_last(row.weight.grad),
               row.bias.grad]
    return {"norm": abs(norm - ref_norm) / ref_norm,
            "clipped": max((a - p.grad).abs().max().item() for a, p in zip(clipped, ref_params))}


def _check_rng_and_broadcast():
    """The tracker forks and restores the generator of mpu's device (CUDA's on a GPU, whose draws differ from the
    CPU's): references come from generators of that device."""
    import mpu
    device = _device()
    mpu.model_parallel_cuda_manual_seed(123)
    before = _device_rng_state(device)
    tracker = mpu.get_cuda_rng_tracker()
    with tracker.fork():
        forked = torch.rand(4, device=device)
    after = _device_rng_state(device)
    default_draw = torch.rand(4, device=device)
    ref = torch.Generator(device=device).manual_seed(123 + 2718 + mpu.get_model_parallel_rank())
    expected_default = torch.rand(4, device=device, generator=torch.Generator(device=device).manual_seed(123))
    # broadcast_data: only model-parallel rank 0's data counts; it returns the batch on mpu's device.
    rank = mpu.get_model_parallel_rank()
    data = {"a": torch.arange(6).view(2, 3) + 100 * rank, "b": torch.arange(4) * (rank + 1)}
    out = mpu.broadcast_data(["a", "b"], data, torch.int64)
    return {"restored": torch.equal(before, after),
            "forked_stream": torch.equal(forked, torch.rand(4, device=device, generator=ref)),
            "default_stream": torch.equal(default_draw, expected_default),
            "broadcast": out["a"].device == device and torch.equal(out["a"].cpu(), torch.arange(6).view(2, 3))
            and torch.equal(out["b"].cpu(), torch.arange(4))}


COLLECTIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_collectives():
    """The collectives the ZeRO engine and mpu launch (all_reduce, reduce_scatter_tensor, all_gather_into_tensor,
    broadcast, reduce; synchronous and async_op) in every training dtype, on the process group's backend with
    tensors on mpu's device: what NCCL runs under `pytest --device cuda` (also at world size 1, one GPU). Rank r
    contributes r + 1 everywhere, so each result is a known small integer, exact in every dtype."""
    import mpu
    import torch.distributed as dist
    device, rank, world = _device(), dist.get_rank(), dist.get_world_size()
    total = world * (world + 1) / 2
    ok = {"backend is mpu's": dist.get_backend() == mpu.get_backend()}
    for dtype in COLLECTIVE_DTYPES:
        mine = torch.full((2 * world,), rank + 1.0, dtype=dtype, device=device)
        summed = mine.clone()
        dist.all_reduce(summed)
        scattered = torch.empty(2, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(scattered, mine)
        gathered = torch.empty(2 * world, dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, mine[:2].contiguous())
        broadcast = mine.clone()
        dist.broadcast(broadcast, src=world - 1)
        reduced = mine.clone()
        dist.reduce(reduced, dst=0)
        handle_sum = mine.clone()
        dist.all_reduce(handle_sum, async_op=True).wait()
        expect = {"all_reduce": (summed, total), "reduce_scatter_tensor": (scattered, total),
                  "broadcast": (broadcast, world), "all_reduce async": (handle_sum, total)}
        if rank == 0:
            expect["reduce"] = (reduced, total)
        for name, (tensor, value) in expect.items():
            ok[f"{name} {dtype}"] = tensor.device == device and bool((tensor.float() == value).all())
        ranks = torch.arange(1, world + 1, dtype=torch.float32, device=device).repeat_interleave(2)
        ok[f"all_gather_into_tensor {dtype}"] = bool((gathered.float() == ranks).all())
    return ok


def _all_checks(vocab):
    return {"layers": _check_layers(), "cross_entropy": _check_cross_entropy(vocab),
            "clip": _check_clip_grad_norm(), "rng": _check_rng_and_broadcast(), "collectives": _check_collectives()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mpu_matches_single_process(world_size):
    vocab = 19  # not divisible by 2 or 4
    results = run_distributed(_all_checks, world_size, args=(vocab,), model_parallel_size=world_size)
    for rank, result in enumerate(results):
        for name, diff in result["layers"].items():
            assert diff <= TOL, f"rank {rank} {name}: {diff}"
        assert result["cross_entropy"]["loss"] <= TOL
        assert result["cross_entropy"]["grad"] <= TOL
        assert result["cross_entropy"]["input_changed"] == 0.0
        assert result["clip"]["norm"] <= 1e-6
        assert result["clip"]["clipped"] <= TOL
        assert all(result["rng"].values()), result["rng"]
        assert all(result["collectives"].values()), {k: v for k, v in result["collectives"].items() if not v}


def test_model_parallel_size_must_divide_world():
    with pytest.raises(RuntimeError, match="not divisible by model-parallel size"):
        run_distributed(math.sqrt, 2, args=(4.0,), model_parallel_size=4)


def test_replicated_kv_head_gradients_sum_over_their_own_holders_at_mp4(monkeypatch):
    """4 query heads, 2 key/value heads, mp 4 (mocked group): ranks 0-1 hold head 0, ranks 2-3 head 1. Each copy's
    gradient holds its query head's share c_r; after the hook every copy holds its head's whole gradient, i.e. the
    rows of the full gradient [q; k0 = c0 + c1, k1 = c2 + c3; v likewise] that GroupedQKVStride.split gives the
    rank (at mp 2 with one kv head every rank's holders are ranks 0-1: a wrong holder group would not show)."""
    import types
    import mpu.layers as layers
    stride = layers.GroupedQKVStride(query_rows=8, kv_rows=4, head_dim=2)       # d = 2, columns 3
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(8, 3, generator=generator, dtype=torch.float64)
    shares = [torch.randn(4, 3, generator=generator, dtype=torch.float64) for _ in range(4)]   # [k_r; v_r]
    k = torch.cat([shares[0][:2] + shares[1][:2], shares[2][:2] + shares[3][:2]])
    v = torch.cat([shares[0][2:] + shares[1][2:], shares[2][2:] + shares[3][2:]])
    full = torch.cat([q, k, v])
    copies = [torch.cat([q[2 * r:2 * r + 2], shares[r]]) for r in range(4)]       # each rank's raw gradient

    def all_gather(out, tensor, group=None):
        for target, copy in zip(out, copies):
            target.copy_(copy.narrow(0, 2, 4))
    monkeypatch.setattr(layers, "dist", types.SimpleNamespace(all_gather=all_gather))
    monkeypatch.setattr(layers, "get_model_parallel_group", lambda: None)
    assert stride.replicas(4) == 2
    for rank in range(4):
        monkeypatch.setattr(layers, "get_model_parallel_rank", lambda: rank)
        got = layers._ReplicatedKVGrad(stride, 4)(copies[rank].clone())
        assert torch.equal(got, stride.split(full, 0, 4, rank)), rank
