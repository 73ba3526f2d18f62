"""mpu's context-parallel groups and ring attention (mpu/initialize.py, mpu/context_parallel.py).

What is asserted:
- the rank -> group tables of Megatron-LM's order tp, cp, dp, pp for 8 ranks at tp 2 x cp 2 x dp 2 and at
  tp 1 x cp 4 x dp 2, checked on every rank against tables written out by hand; at cp 1 the data-parallel group
  with and without context parallelism is the same group (the layout without context parallelism);
- the held positions of the load-balanced layout (chunks i and 2C - 1 - i) against a hand-written table, and a
  length not divisible by 2C refused in one line naming the fix;
- ring attention at C = 2 and C = 4 (fp32, causal, grouped-query 4 query heads over 2 key/value heads, and plain
  multi-head; blocks through the fused CPU kernel and through the math path, whole and one query row at a time):
  each rank's output and its q/k/v gradients equal the slices of plain full attention computed in one process
  (torch SDPA, is_causal, in fp64) within 1e-6 relative. A bug letting a token see the next chunk (a wrong step
  plan at the chunk borders, a causal mask one off) changes outputs by ~1e-1 and fails;
- the activation bytes autograd keeps per rank at C = 2 equal memory.activation_bytes_saved for s/C tokens with
  ring attention's layout, for no, selective and full recomputation, about half of C = 1's.
"""
import pytest
import torch
import torch.nn.functional as F

import mpu
from megatron.spawn import run_distributed
from mpu.context_parallel import held_positions, SequenceLengthError
from tests.helpers import max_relative_difference


def test_held_positions_table():
    assert held_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert held_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert held_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert held_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert held_positions(4, 1, 0).tolist() == [0, 1, 2, 3]
    with pytest.raises(SequenceLengthError, match=r"\(12\) is not divisible by 2C = 8 \(context-parallel size 4\)"):
        held_positions(12, 4, 0)


def _groups(tp, cp):
    import torch.distributed as dist
    mpu.initialize_model_parallel(tp, context_parallel_size=cp)

    def members(group):
        return sorted(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]
    return {"tp": members(mpu.get_model_parallel_group()), "cp": mpu.get_context_parallel_global_ranks(),
            "dp": members(mpu.get_data_parallel_group()),
            "dp_cp": members(mpu.get_data_parallel_group(with_context_parallel=True)),
            "cp_rank": mpu.get_context_parallel_rank(), "cp_size": mpu.get_context_parallel_world_size(),
            "same_at_cp1": mpu.get_data_parallel_group(True) is mpu.get_data_parallel_group()}


def _find(table, rank):
    return next(group for group in table if rank in group)


@pytest.mark.parametrize("tp,cp,tables", [
    (2, 2, {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
    (1, 4, {"tp": [[r] for r in range(8)], "cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp_cp": [list(range(8))]}),
    (2, 1, {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[r] for r in range(8)],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
])
def test_group_tables(tp, cp, tables):
    results = run_distributed(_groups, 8, args=(tp, cp))
    for rank, got in enumerate(results):
        for name, table in tables.items():
            assert got[name] == _find(table, rank), (rank, name)
        assert got["cp_size"] == cp and got["cp_rank"] == got["cp"].index(rank)
        assert got["same_at_cp1"] == (cp == 1)


def _ring(cp, heads, kv_heads, seq, kernel, dtype=torch.float32):
    import mpu.context_parallel
    mpu.context_parallel.CPU_FUSED_KERNEL = kernel == "fused"
    mpu.context_parallel.SCORE_ELEMENTS = {"fused": 2 ** 22, "math": 2 ** 22, "math by rows": 1}[kernel]
    mpu.initialize_model_parallel(1, context_parallel_size=cp)
    generator = torch.Generator().manual_seed(5)
    b, d = 2, 8
    q = torch.randn(b, heads, seq, d, generator=generator, dtype=dtype)
    k = torch.randn(b, kv_heads, seq, d, generator=generator, dtype=dtype)
    v = torch.randn(b, kv_heads, seq, d, generator=generator, dtype=dtype)
    grad = torch.randn(b, heads, seq, d, generator=generator, dtype=dtype)
    local = [mpu.slice_for_context_parallel(t, seq_dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = mpu.ring_attention(*local)
    out.backward(mpu.slice_for_context_parallel(grad, seq_dim=2))
    return out.detach(), [t.grad for t in local], (q, k, v, grad)


def _reference(q, k, v, grad):
    q, k, v, grad = (t.double() for t in (q, k, v, grad))     # fp64: the reference's own rounding out of the way
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.size(1) // k.size(1)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    out.backward(grad)
    return out.detach(), [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("kernel", ["fused", "math", "math by rows"])
@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 2), (4, 4, 4)])
def test_ring_attention_equals_full_attention(cp, heads, kv_heads, kernel):
    """kernel: the blocks through SDPA's fused CPU kernel (the CPU's default), through the math path (other
    devices'), or the math path one query row at a time (mpu.context_parallel._forward_by_rows, SCORE_ELEMENTS)."""
    seq = 8 * cp      # chunks of 4 tokens
    results = run_distributed(_ring, cp, args=(cp, heads, kv_heads, seq, kernel))
    ref_out, ref_grads = _reference(*results[0][2])
    for rank, (out, grads, _) in enumerate(results):
        index = held_positions(seq, cp, rank)
        assert max_relative_difference(out, ref_out.index_select(2, index)) < 1e-6
        for got, ref in zip(grads, ref_grads):
            assert max_relative_difference(got, ref.index_select(2, index)) < 1e-6, rank


# ---- the activation memory estimate (megatron/guards/memory.py) against what autograd keeps ------------------------

MEASURE_LAYERS, MEASURE_SEQ, MEASURE_BATCH, HIDDEN, HEADS = 2, 64, 2, 32, 4
MEASURE_MODES = {"none": mpu.RecomputeConfig(), "selective": mpu.RecomputeConfig("selective"),
                 "full uniform 1": mpu.RecomputeConfig("full", "uniform", 1)}


def _measured_activation_bytes(cp):
    from tests.model.test_recompute import _saved_activation_bytes
    mpu.initialize_model_parallel(1, context_parallel_size=cp)
    mpu.model_parallel_cuda_manual_seed(1234)
    stack = mpu.ParallelTransformer(MEASURE_LAYERS, HIDDEN, HEADS, 0.0, 0.0, final_layernorm=False)
    x = torch.randn(MEASURE_BATCH, MEASURE_SEQ // cp, HIDDEN, generator=torch.Generator().manual_seed(7))
    measured = {}
    for name, config in MEASURE_MODES.items():
        stack.recompute = config
        measured[name] = _saved_activation_bytes(stack, x.to(mpu.get_device()))
    return measured


def test_saved_activation_bytes_match_the_context_parallel_formula():
    """At C = 2 each rank keeps what the estimate says for its s/C tokens with ring attention's fp32 output and
    log-sum-exp (memory.ActivationLayout.ring_attention), for no, selective and full recomputation; about half
    of C = 1's (measured in one process with SDPA's fused CPU kernel)."""
    from megatron.guards import memory
    ring = memory.ActivationLayout.for_run("cpu", 4, 0.0, 0.0, context_parallel_size=2)
    alone = run_distributed(_measured_activation_bytes, 1, args=(1,))[0]
    for rank, result in enumerate(run_distributed(_measured_activation_bytes, 2, args=(2,))):
        for mode, measured in result.items():
            shape = (MEASURE_LAYERS, MEASURE_SEQ // 2, MEASURE_BATCH, HIDDEN, HEADS, 1)
            assert measured == memory.activation_bytes_saved(*shape, MEASURE_MODES[mode], ring), (rank, mode)
            assert 0.4 < measured / alone[mode] <= 0.55, (mode, measured, alone[mode])


# ---- one ring block through the device's fused kernel (the CPU's flash kernel; CUDA's flash kernel under
# tools/gpu_check.sh, which runs this file with --device cuda) ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, causal", [(8, True), (4, False)])
def test_a_block_on_the_devices_kernel_equals_fp64_attention(test_device, dtype, rows, causal):
    """One block as the ring runs it: q [1, 4, rows, 64] against k, v [1, 4, 8, 64] (the causal block square, the
    others rectangular); forward (out, lse) and backward (given the block's own out and lse as the final ones) against
    the math path in fp64. bf16 in: within 2e-2 relative (bf16 rounding of q, k, v and of the kernel's output); fp32
    within 1e-5. On CUDA a bf16 block must take the flash kernel (not the fp32 math path)."""
    from mpu import context_parallel as cp
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (torch.randn(1, 4, n, 64, generator=gen) for n in (rows, 8, 8, rows))
    q, k, v = (t.to(test_device, dtype) for t in (q, k, v))
    forward, backward = cp._block_kernels(q)
    if test_device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 8:
        assert forward is cp._flash_kernel_forward
    ref_out, ref_lse = cp._block_forward(*(t.double() for t in (q, k, v)), 0.125, causal)
    out, lse = forward(q, k, v, 0.125, causal)
    grads = backward(q, k, v, out, lse, grad_out.to(test_device), 0.125, causal)
    ref_grads = cp._block_backward(*(t.double() for t in (q, k, v)), ref_out, ref_lse,
                                   grad_out.to(test_device).double(), 0.125, causal)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert out.dtype == lse.dtype == torch.float32
    assert max_relative_difference(out.double(), ref_out) < tolerance
    assert max_relative_difference(lse.double(), ref_lse) < tolerance
    for got, ref in zip(grads, ref_grads):
        assert max_relative_difference(got.double(), ref) < tolerance
