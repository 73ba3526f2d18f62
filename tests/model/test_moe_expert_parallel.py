"""Expert parallelism (mpu/expert_parallel.py, the MoE layer's all-to-all dispatch) against the same layer in one
process: each rank's output and input gradient, the gradient of the experts it holds (summed over every rank's
tokens), its router gradient; at EP 2 and EP 4, dropless and with a capacity that drops; the group layout; and
the zero-token case (experts no token picks, a rank that receives nothing) finishing with the right (zero)
gradients instead of hanging."""
import pytest
import torch
import torch.distributed as dist

from megatron.spawn import run_distributed

HIDDEN, FFN, EXPERTS = 8, 12, 8


def _config(capacity_factor):
    import mpu
    return mpu.MoEConfig(num_experts=EXPERTS, topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                         capacity_factor=capacity_factor)


def _inputs(rank, starve):
    """Rank `rank`'s tokens [2, 3, h] and the probe its output is dotted with. starve: positive tokens, so that the
    router _starve writes sends every token to experts 0 and 1."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 3, HIDDEN, generator=generator)
    if starve:
        x = x.abs() + 0.1
    return x, torch.randn(2, 3, HIDDEN, generator=generator)


def _build(capacity_factor, starve):
    import mpu
    torch.manual_seed(3)
    layer = mpu.MoEMLP(HIDDEN, FFN, _config(capacity_factor), mpu.init_method_normal(0.5),
                       mpu.init_method_normal(0.5), swiglu=True, bias=False)
    if starve:   # experts 0, 1 score positive on positive tokens, every other expert negative
        with torch.no_grad():
            layer.router.weight.copy_(torch.rand(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(9)))
            layer.router.weight[2:].neg_()
    return layer


def _run(layer, rank, starve):
    import mpu
    mpu.set_aux_loss_scale(1.0)
    x, probe = _inputs(rank, starve)
    x.requires_grad_(True)
    (layer(x) * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return layer(x.detach()).detach(), x.grad, grads, layer.last_statistics[1]


def _reference(world, capacity_factor, starve):
    """One process, the whole layer, each rank's tokens in turn: per rank (output, input gradient, gradients)."""
    layer = _build(capacity_factor, starve)
    results = []
    for rank in range(world):
        layer.zero_grad()
        results.append(_run(layer, rank, starve))
    return results, {name: p.detach().clone() for name, p in layer.named_parameters()}


def _expert_parallel(ep, capacity_factor, starve):
    import mpu
    mpu.initialize_expert_parallel(ep)
    layer = _build(capacity_factor, starve)
    rank = dist.get_rank()
    output, x_grad, grads, counts = _run(layer, rank, starve)
    weights = {name: p.detach().clone() for name, p in layer.named_parameters()}
    groups = (dist.get_process_group_ranks(mpu.get_expert_model_parallel_group()),
              dist.get_process_group_ranks(mpu.get_expert_data_parallel_group()))
    return output, x_grad, grads, counts, weights, groups


@pytest.mark.parametrize("ep,capacity_factor,starve", [(2, None, False), (2, 0.5, False), (4, None, False),
                                                      (2, None, True)])
def test_expert_parallel_layer_matches_one_process(ep, capacity_factor, starve):
    reference, ref_weights = run_distributed(_reference, 1, args=(ep, capacity_factor, starve),
                                             model_parallel_size=1)[0]
    results = run_distributed(_expert_parallel, ep, args=(ep, capacity_factor, starve), model_parallel_size=1,
                              timeout=120)      # a hang fails here instead of waiting forever
    for rank, (output, x_grad, grads, counts, weights, groups) in enumerate(results):
        ref_output, ref_x_grad, ref_grads, ref_counts = reference[rank]
        assert groups == (list(range(ep)), [rank])
        assert torch.equal(counts, ref_counts)
        assert (output - ref_output).abs().max() <= 1e-6 * ref_output.abs().max()
        assert (x_grad - ref_x_grad).abs().max() <= 1e-6 * ref_x_grad.abs().max()
        local = [name for name in weights if name.startswith("experts.")]
        assert len(local) == 2 * EXPERTS // ep
        for name in weights:    # every rank's experts are the single-process model's, bitwise
            assert torch.equal(weights[name], ref_weights[name]), name
        router, ref_router = grads["router.weight"], ref_grads["router.weight"]
        assert (router - ref_router).abs().max() <= 1e-6 * ref_router.abs().max()
        for name in local:      # this rank's experts: the gradient of every rank's tokens
            total = sum(reference[r][2][name] for r in range(ep))
            assert (grads[name] - total).abs().max() <= 1e-6 * max(1.0, float(total.abs().max())), name
    if starve:                  # experts 2..7 got no token on any rank; rank 1 (experts 4..7) received nothing
        assert [int(c) for c in results[0][3][2:]] == [0] * (EXPERTS - 2)
        for name, grad in results[1][2].items():
            if name.startswith("experts."):
                assert torch.count_nonzero(grad) == 0, name
        assert any(torch.count_nonzero(g) for n, g in results[0][2].items() if n.startswith("experts.0."))


def test_expert_parallel_layout():
    from mpu.expert_parallel import expert_parallel_layout
    # 8 ranks, tensor-parallel 2: data-parallel groups [0 2 4 6] and [1 3 5 7] (mpu/expert_parallel.py's table)
    assert expert_parallel_layout([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert expert_parallel_layout([1, 3, 5, 7], 4) == ([[1, 3, 5, 7]], [[1], [3], [5], [7]])
    assert expert_parallel_layout([0, 1, 2, 3], 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
