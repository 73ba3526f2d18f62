"""Muon under ZeRO exchanges only the matrices that cross a partition boundary (megatron/zero/muon.py's
partition_update), not the whole Nesterov update: at data parallel 4 on a flat layout of hand-placed matrices
(partitions of 64 elements: one matrix ends exactly at a boundary, one spans three partitions), the bytes each rank
sends per step are one all-reduce of the crossing matrix only, and each rank's orthogonalized partition equals the
published algorithm (Keller Jordan's Newton-Schulz, tests/zero/test_muon.py) run on every whole matrix in one
process."""
import torch

from megatron.spawn import run_distributed

SHAPES = [(6, 5), (2, 5), (4, 6), (4, 4), (10, 12), (3, 11)]
# flat offsets: (0, 30) (30, 40) (40, 64) (64, 80) (80, 200) (200, 233); padded to 256, partitions of 64:
# (40, 64) ends at the first boundary and (64, 80) starts there (neither crosses); (80, 200) spans ranks 1, 2, 3
CROSSING_NUMEL = 120
DP = 4


def _flat_gradient():
    return torch.randn(256, generator=torch.Generator().manual_seed(3))


def _rank_update():
    """(this rank's orthogonalized partition, the bytes it sent by collective)."""
    import torch.distributed as dist
    from megatron.guards.comm_bytes import CommCounter
    from megatron.zero.muon import MUON_DEFAULTS, partition_update
    from megatron.zero.partition import FlatLayout
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    layout = FlatLayout(params, DP, dist.get_rank())
    assert layout.partition_size == 64 and layout.offsets[4] == (80, 200)
    start, end = layout.own_range
    grad = _flat_gradient()[start:end].clone()
    group = dict(MUON_DEFAULTS)
    with CommCounter() as counter:
        out = partition_update(grad, torch.zeros_like(grad), layout, group, dist.group.WORLD, (None, 0, 1))
    return out, dict(counter.bytes_by_op)


def _published(momentum=0.95):
    """The flat orthogonalized update of every matrix, one process: Nesterov from a zero buffer, NS5, the shape
    scale sqrt(max(1, rows / cols))."""
    from tests.zero.test_muon import reference_newton_schulz
    gradient = _flat_gradient()
    update = gradient.lerp(torch.zeros(256).lerp(gradient, 1 - momentum), momentum)
    out, offset = torch.zeros(256), 0
    for rows, cols in SHAPES:
        matrix = update[offset:offset + rows * cols].view(rows, cols)
        scale = max(1.0, rows / cols) ** 0.5
        out[offset:offset + rows * cols] = (reference_newton_schulz(matrix) * scale).reshape(-1)
        offset += rows * cols
    return out


def test_muon_exchanges_only_the_matrices_crossing_a_partition():
    results = run_distributed(_rank_update, DP)
    reference = _published()
    for rank, (out, sent) in enumerate(results):
        # the ring all-reduce of the crossing matrix's 480 bytes (2 (n-1)/n of it per rank); the whole update's
        # all-gather was 3/4 x 1024 bytes, and a matrix ending at a boundary counted as crossing would add 96
        assert sent == {"all_reduce": 2 * (DP - 1) / DP * CROSSING_NUMEL * 4}, (rank, sent)
        assert torch.allclose(out, reference[64 * rank:64 * (rank + 1)], rtol=1e-5, atol=1e-6), rank
