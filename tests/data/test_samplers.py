"""MegatronPretrainingSampler: resuming at consumed_samples=k yields exactly the tail of the uninterrupted order."""
import pytest

from megatron.data.samplers import MegatronPretrainingSampler


def _batches(total, consumed, micro, rank, dp, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, micro, rank, dp, drop_last))


@pytest.mark.parametrize("micro, dp", [(1, 1), (2, 2), (3, 4), (4, 1)])
def test_uninterrupted_order(micro, dp):
    total = 50
    per_rank = [_batches(total, 0, micro, r, dp) for r in range(dp)]
    steps = total // (micro * dp)
    for step in range(steps):
        global_batch = sum((per_rank[r][step] for r in range(dp)), [])
        assert global_batch == list(range(step * micro * dp, (step + 1) * micro * dp))
    assert all(len(b) == steps for b in per_rank)
    assert len(MegatronPretrainingSampler(total, 0, micro, 0, dp)) == steps


@pytest.mark.parametrize("micro, dp", [(2, 2), (3, 4)])
def test_resume_yields_the_tail(micro, dp):
    total = 61
    for rank in range(dp):
        full = _batches(total, 0, micro, rank, dp)
        for step in range(len(full) + 1):
            consumed = step * micro * dp   # what a checkpoint after `step` steps records
            resumed = _batches(total, consumed, micro, rank, dp) if consumed < total else []
            assert resumed == full[step:]


def test_drop_last_false_gives_each_rank_its_part_of_the_tail():
    assert _batches(11, 0, 2, 0, 2, drop_last=False)[-1] == [8, 9]
    assert _batches(11, 0, 2, 1, 2, drop_last=False)[-1] == [10]
    assert _batches(9, 0, 2, 1, 2, drop_last=False)[-1] == [6, 7]   # rank 1 has no part of the tail [8]
    assert len(MegatronPretrainingSampler(9, 0, 2, 1, 2, drop_last=False)) == 2
    assert len(MegatronPretrainingSampler(9, 0, 2, 0, 2, drop_last=False)) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="consumed_samples=10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="total_samples=0"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
