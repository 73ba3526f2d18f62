"""partition.py's index arithmetic in one process: padded sizes, each rank's [start, end) of the flat buffer,
which parameter pieces fall in a range and who owns them, the flat buffer's views, and the full_numel /
full_shape it uses (mpu.utils). Expected values by hand (ALIGNMENT = 32 elements: a flat buffer is padded to a
multiple of 32 * dp)."""
import pytest
import torch

from megatron.zero.partition import ALIGNMENT, FlatGroup, FlatLayout, padded_size
from mpu.utils import full_numel, full_shape


def params(*sizes, dtype=torch.float32):
    """Parameters whose values are their flat positions (first element of the first one is 0)."""
    out, start = [], 0
    for size in sizes:
        out.append(torch.nn.Parameter(torch.arange(start, start + size, dtype=dtype)))
        start += size
    return out


def test_alignment_the_tables_below_assume():
    assert ALIGNMENT == 32


# (numel, dp) -> padded numel, partition size
PADDED = {(0, 1): (0, 0), (1, 1): (32, 32), (7, 1): (32, 32), (32, 1): (32, 32), (33, 1): (64, 64),
          (7, 2): (64, 32), (7, 4): (128, 32), (13, 4): (128, 32), (64, 2): (64, 32), (65, 2): (128, 64),
          (128, 4): (128, 32), (129, 4): (256, 64), (7, 3): (96, 32), (97, 3): (192, 64), (70, 2): (128, 64)}


@pytest.mark.parametrize("numel, dp", sorted(PADDED))
def test_padded_size_and_partition_size(numel, dp):
    padded, partition = PADDED[(numel, dp)]
    assert padded_size(numel, dp) == padded
    layout = FlatLayout(params(numel) if numel else [], dp, 0)
    assert (layout.numel, layout.padded_numel, layout.partition_size) == (numel, padded, partition)
    assert layout.padded_numel - layout.numel == padded - numel          # the padding, at the end


@pytest.mark.parametrize("sizes, dp", [((7,), 2), ((7,), 4), ((13,), 4), ((64,), 2), ((128,), 4), ((5, 3, 6), 2),
                                       ((40, 30), 2), ((33, 1, 65), 3), ((31, 2, 200, 9), 4)])
def test_rank_ranges_tile_the_flat_buffer_and_own_each_element_once(sizes, dp):
    layout = FlatLayout(params(*sizes), dp, 0)
    ranges = [layout.partition_range(r) for r in range(dp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(end == next_start for (_, end), (next_start, _) in zip(ranges, ranges[1:]))     # no gap, no overlap
    assert all(end - start == layout.partition_size for start, end in ranges)
    owned = [0] * len(sizes)
    for start, end in ranges:
        for index, lo, hi in layout.segments(start, end):
            owned[index] += hi - lo
    assert owned == list(sizes)                     # every element of every parameter in exactly one partition


def test_odd_size_over_two_and_four_ranks_leaves_the_later_ranks_only_padding():
    """7 elements: dp 2 -> [0, 32) holds all of them, [32, 64) is padding; dp 4 -> ranks 1-3 are padding."""
    for dp, ranges in ((2, [(0, 32), (32, 64)]), (4, [(0, 32), (32, 64), (64, 96), (96, 128)])):
        for rank, own in enumerate(ranges):
            layout = FlatLayout(params(7), dp, rank)
            assert layout.own_range == own
            assert layout.own_unpadded_range() == ((0, 7) if rank == 0 else (7, 7))
            assert layout.segments(*own) == ([(0, 0, 7)] if rank == 0 else [])


def test_parameters_ending_exactly_at_a_partition_boundary():
    """a (32) and b (32) at dp 2: no padding, rank 0 owns exactly a, rank 1 exactly b (no empty piece of the
    neighbour that merely touches the boundary)."""
    layout = FlatLayout(params(32, 32), 2, 0)
    assert layout.padded_numel == 64 and layout.own_unpadded_range() == (0, 32)
    assert layout.segments(0, 32) == [(0, 0, 32)]
    assert layout.segments(32, 64) == [(1, 32, 64)]
    assert layout.owners(0, 64) == [(0, 0, 32), (1, 32, 64)]


def test_a_parameter_spanning_the_boundary_between_two_ranks():
    """a (40) and b (30) at dp 2: padded 128, partitions of 64. Rank 0 owns a and b[0:24], rank 1 b[24:30] and 58
    padding elements."""
    layout = FlatLayout(params(40, 30), 2, 1)
    assert layout.offsets == [(0, 40), (40, 70)]
    assert layout.segments(0, 64) == [(0, 0, 40), (1, 40, 64)]
    assert layout.segments(64, 128) == [(1, 64, 70)]
    assert layout.own_range == (64, 128) and layout.own_unpadded_range() == (64, 70)
    assert layout.owners(*layout.offsets[1]) == [(0, 40, 64), (1, 64, 70)]      # b, split at 64
    assert layout.owners(0, 40) == [(0, 0, 40)]
    assert layout.owners(63, 65) == [(0, 63, 64), (1, 64, 65)]
    assert layout.owners(64, 128) == [(1, 64, 128)]


def test_owners_over_four_ranks_and_an_empty_layout():
    layout = FlatLayout(params(100), 4, 2)                      # padded 128, partitions of 32
    assert layout.owners(10, 100) == [(0, 10, 32), (1, 32, 64), (2, 64, 96), (3, 96, 100)]
    assert layout.owners(32, 64) == [(1, 32, 64)]
    empty = FlatLayout([], 2, 1)
    assert (empty.numel, empty.padded_numel, empty.partition_size) == (0, 0, 0)
    assert empty.owners(0, 0) == [] and empty.segments(0, 0) == []


def test_one_partition_means_rank_zero_owns_all():
    layout = FlatLayout(params(7, 9), 1, 3)           # stage 0: the rank argument does not matter
    assert layout.rank == 0 and layout.own_range == (0, 32) and layout.own_unpadded_range() == (0, 16)


def test_mixed_dtypes_in_one_group_are_refused():
    mixed = params(3) + params(4, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"mixed dtypes \['torch.float16', 'torch.float32'\]"):
        FlatLayout(mixed, 2, 0)


def test_counted_own_ranges_split_duplicated_and_shared_parameters():
    """a (40, split across model-parallel ranks), b (30, duplicated), c (10, the pipeline's second copy of a tied
    weight) at dp 1: a counts everywhere, b only on model-parallel rank 0, c nowhere; adjacent counted pieces merge."""
    a, b, c = params(40, 30, 10)
    a.model_parallel, c.shared = True, True
    layout = FlatLayout([a, b, c], 1, 0)
    assert layout.counted_own_ranges(0, 2) == ([(0, 70)], [(70, 80)])
    assert layout.counted_own_ranges(1, 2) == ([(0, 40)], [(40, 80)])
    rank1 = FlatLayout([a, b, c], 2, 1)                  # padded 128: rank 1 owns [64, 128) -> b[24:30], c
    assert rank1.counted_own_ranges(0, 2) == ([(0, 6)], [(6, 16)])


def test_counted_own_ranges_leave_replicated_kv_heads_to_their_first_holder():
    """A fused q/k/v [q 4 rows; k 1 row; v 1 row] x 3 columns at model-parallel size 4 (mpu.GroupedQKVStride: one
    key/value head of d = 1, replicated on all 4 ranks): each rank's piece is [q_r; k; v], 3 rows = 9 elements
    [0, 9), its k and v rows [3, 9). Rank 0 counts them, ranks 1-3 leave them out; a 5-element b (split) follows;
    at dp 2 (padded to 64, partitions of 32) the cut holds inside the first data-parallel partition."""
    import mpu
    qkv, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(5))
    for p, stride in ((qkv, mpu.GroupedQKVStride(query_rows=4, kv_rows=1, head_dim=1)), (b, 1)):
        p.model_parallel, p.partition_dim, p.partition_stride = True, 0, stride
    layout = FlatLayout([qkv, b], 1, 0)
    assert layout.counted_own_ranges(0, 4) == ([(0, 14)], [])
    for rank in (1, 2, 3):
        assert layout.counted_own_ranges(rank, 4) == ([(0, 3), (9, 14)], [(3, 9)]), rank
    assert layout.counted_own_ranges(1, 1) == ([(0, 14)], [])     # at mp 1 nothing is replicated
    assert FlatLayout([qkv, b], 2, 0).counted_own_ranges(3, 4) == ([(0, 3), (9, 14)], [(3, 9)])
    assert FlatLayout([qkv, b], 2, 1).counted_own_ranges(3, 4) == ([], [])


def test_full_numel_and_shape_of_whole_and_released_parameters():
    whole = torch.nn.Parameter(torch.zeros(3, 5))
    assert full_numel(whole) == 15 and full_shape(whole) == (3, 5)
    released = torch.nn.Parameter(torch.zeros(3, 5))
    released.ds_shape, released.ds_numel = released.shape, released.numel()
    released.data = torch.empty(0)                       # what stage 3 / zero.Init leave while it is released
    assert full_numel(released) == 15 and full_shape(released) == (3, 5)
    layout = FlatLayout([released, whole], 2, 0)
    assert layout.offsets == [(0, 15), (15, 30)] and layout.padded_numel == 64


def test_full_shape_of_a_released_scalar_parameter():
    """A scalar parameter released by stage 3 / zero.Init: its whole shape is (), not the placeholder's (0,)
    (a stage-3 run with such a parameter fails with "shape '[0]' is invalid for input of size 1")."""
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    scalar.ds_shape, scalar.ds_numel = scalar.shape, scalar.numel()
    scalar.data = torch.empty(0)
    assert full_numel(scalar) == 1
    assert full_shape(scalar) == ()


def test_flat_group_views_and_padding():
    """The docstring's three parameters (5, 3, 6) at dp 2: values kept, parameters are views of the flat
    buffer, padding zero, each rank's own partition its slice."""
    for rank in (0, 1):
        a, b, c = params(5, 3, 6)
        c.data = c.data.view(2, 3)
        group = FlatGroup([a, b, c], 2, rank)
        assert group.flat.shape == (64,) and group.partition_size == 32
        assert torch.equal(group.flat[:14], torch.arange(14.0)) and not group.flat[14:].any()
        assert c.shape == (2, 3) and torch.equal(c.detach(), torch.arange(8.0, 14.0).view(2, 3))
        group.flat[9] = -1.0
        assert c[0, 1].item() == -1.0                          # a view, not a copy
        own = group.own_partition()
        assert own.data_ptr() == group.flat[32 * rank:].data_ptr() and own.numel() == 32
        assert group.parameter_bytes() == 64 * 4
