"""Muon under ZeRO exchanges only the matrices that cross a partition boundary (megatron/zero/muon.py's
partition_update), each orthogonalized once by the holder of its largest piece: on a flat layout of hand-placed
matrices, the bytes each rank sends and receives per step are its pieces (a holder) or the rest of the matrix (the
owner), never more than the crossing matrices' bytes, and each rank's orthogonalized partition equals the published
algorithm (Keller Jordan's Newton-Schulz, tests/zero/test_muon.py) run on every whole matrix in one process."""
import pytest
import torch

from megatron.spawn import run_distributed

SHAPES = [(5, 8), (12, 9), (11, 8), (5, 4)]
NUMEL = 256     # flat offsets (0, 40) (40, 148) (148, 236) (236, 256): no padding at dp 2 or 4
# dp 4, partitions of 64: (12, 9) has pieces 24 | 64 | 20 on ranks 0, 1, 2 (owner 1: not the first holder);
# (11, 8) has 44 | 44 on ranks 2, 3 (a tie: owner 2, which also holds a piece of (12, 9)); (5, 4) ends exactly at
# the last boundary. dp 2, partitions of 128: (12, 9) has 88 | 20 (owner 0), (11, 8) is inside rank 1.
# Elements each rank sends (= receives) per step, by hand: a holder its piece, the owner the rest of the matrix.
EXCHANGED = {2: [20, 20], 4: [24, 20 + 24, 20 + 44, 44]}
CROSSING = {2: 108, 4: 108 + 88}


def _flat_gradient():
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))


def _rank_update(strided):
    """(this rank's orthogonalized partition, the bytes it sent and received by op). strided: world 4 as two
    data-parallel groups [0, 2] and [1, 3] (an expert-data-parallel layout: group rank 1 is global rank 2 or 3)."""
    import torch.distributed as dist
    from megatron.guards.comm_bytes import CommCounter
    from megatron.zero.muon import MUON_DEFAULTS, partition_update
    from megatron.zero.partition import FlatLayout
    group = dist.group.WORLD
    if strided:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = groups[dist.get_rank() % 2]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    layout = FlatLayout(params, dist.get_world_size(group), dist.get_rank(group))
    assert layout.padded_numel == NUMEL and layout.offsets[1] == (40, 148)
    start, end = layout.own_range
    grad = _flat_gradient()[start:end].clone()
    with CommCounter() as counter:
        out = partition_update(grad, torch.zeros_like(grad), layout, dict(MUON_DEFAULTS), group, (None, 0, 1))
    return out, dict(counter.bytes_by_op), dict(counter.received_by_op)


def _published(momentum=0.95):
    """The flat orthogonalized update of every matrix, one process: Nesterov from a zero buffer, NS5, the shape
    scale sqrt(max(1, rows / cols))."""
    from tests.zero.test_muon import reference_newton_schulz
    gradient = _flat_gradient()
    update = gradient.lerp(torch.zeros(NUMEL).lerp(gradient, 1 - momentum), momentum)
    out, offset = torch.zeros(NUMEL), 0
    for rows, cols in SHAPES:
        matrix = update[offset:offset + rows * cols].view(rows, cols)
        scale = max(1.0, rows / cols) ** 0.5
        out[offset:offset + rows * cols] = (reference_newton_schulz(matrix) * scale).reshape(-1)
        offset += rows * cols
    return out


@pytest.mark.parametrize("dp, world", [(2, 2), (4, 4), (2, 4)])
def test_muon_exchanges_only_the_pieces_of_matrices_crossing_a_partition(dp, world):
    results = run_distributed(_rank_update, world, args=(world != dp,), timeout=120)
    reference = _published()
    size = NUMEL // dp
    for global_rank, (out, sent, received) in enumerate(results):
        rank = global_rank // (world // dp)          # its data-parallel rank ([0, 2] and [1, 3] when strided)
        # fp32: 4 bytes an element; the old all-reduce of the crossing matrices sent 2 (n-1)/n of them per rank
        # (1,176 bytes at dp 4), the whole update's all-gather (n-1)/n of 1,024
        assert sent == {"batch_isend_irecv": 4 * EXCHANGED[dp][rank]}, (rank, sent)
        assert received == sent, (rank, received)
        assert sent["batch_isend_irecv"] <= 4 * CROSSING[dp]
        assert torch.allclose(out, reference[size * rank:size * (rank + 1)], rtol=1e-5, atol=1e-6), rank
