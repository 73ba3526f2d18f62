"""bucketing.py in one process (dp 1, no process group): where the stage-2 buckets fall, the fixed order they are
launched in, how many reductions are in flight with overlap_comm, and that the partition gradient is the sum of
the parameters' gradients. The reductions themselves are recorded by a stand-in for `reduce_range` where the order
and the waits are the point (at dp 1 the real one does no communication).

The two-group example used below (bucket size 4; module order a, b, c, so backward produces c, b, a):

    group 0: a (5), c (7)  flat [ a a a a | a c c c | c c c c ]   buckets [8, 12) c; [4, 8) a + c; [0, 4) a
    group 1: b (6)         flat [ b b | b b b b ]                  buckets [2, 6) b; [0, 2) b

A bucket is due when its last gradient is expected: position in backward (c 0, b 1, a 2), the latest of its
pieces: [8, 12) -> 0, group 1's -> 1, [4, 8) and [0, 4) -> 2. Sorted, stable:
    g0[8,12), g1[2,6), g1[0,2), g0[4,8), g0[0,4)
"""
import pytest
import torch

from megatron.zero import bucketing
from megatron.zero.bucketing import BoundaryReducer, BucketReducer
from megatron.zero.config import ZeroConfig
from megatron.zero.partition import FlatGroup, ParallelContext

ONE_RANK = ParallelContext(None, 0, 1, None, 0, 1)
CPU = torch.device("cpu")
EXAMPLE_ORDER = ["g0[8,12)", "g1[2,6)", "g1[0,2)", "g0[4,8)", "g0[0,4)"]


def zero_config(bucket_size, overlap=False, contiguous=True):
    return ZeroConfig(stage=2, reduce_bucket_size=bucket_size, overlap_comm=overlap,
                      contiguous_gradients=contiguous)


def flat_params(*sizes):
    return [torch.nn.Parameter(torch.zeros(size)) for size in sizes]


def example(overlap=False, contiguous=True):
    a, c, b = flat_params(5, 7, 6)
    groups = [FlatGroup([a, c], 1, 0), FlatGroup([b], 1, 0)]
    reducer = BucketReducer(groups, ONE_RANK, zero_config(4, overlap, contiguous), [a, b, c], CPU)
    return reducer, {"a": a, "b": b, "c": c}


def label(groups, flat_group, start, end):
    return f"g{groups.index(flat_group)}[{start},{end})"


def buckets(reducer):
    return [label(reducer.groups, reducer.groups[b.group_index], b.start, b.end) for b in reducer.buckets]


def gradient(param, scale=1.0):
    """The gradient this test gives `param`: its flat positions + 100 * scale (distinct everywhere)."""
    return torch.arange(param.numel(), dtype=torch.float32) + 100.0 * scale


def backward(param, scale=1.0):
    """A backward pass that reaches `param` alone (its post-accumulate hook runs once)."""
    (param * gradient(param, scale)).sum().backward()


class Recorder:
    """Stand-in for reduce_range: records each launch, returns a handle (when asynchronous) that records its wait,
    and how many earlier reductions were still outstanding at each launch."""

    def __init__(self, groups):
        self.groups, self.events, self.outstanding_at_launch, self.outstanding = groups, [], [], 0

    def __call__(self, flat_group, buffer, start, ctx, all_reduce, async_op):
        name = label(self.groups, flat_group, start, start + buffer.numel())
        self.events.append("launch " + name)
        self.outstanding_at_launch.append(self.outstanding)
        if not async_op:
            return []
        self.outstanding += 1
        return [Handle(self, name)]


class Handle:
    def __init__(self, recorder, name):
        self.recorder, self.name = recorder, name

    def wait(self):
        self.recorder.events.append("wait " + self.name)
        self.recorder.outstanding -= 1


def recorded(monkeypatch, reducer):
    recorder = Recorder(reducer.groups)
    monkeypatch.setattr(bucketing, "reduce_range", recorder)
    return recorder


def test_a_parameter_exactly_the_bucket_size_is_one_bucket_and_one_more_element_makes_two():
    (exact,) = flat_params(8)
    reducer = BucketReducer([FlatGroup([exact], 1, 0)], ONE_RANK, zero_config(8), [exact], CPU)
    assert [(b.start, b.end, b.pieces) for b in reducer.buckets] == [(0, 8, [(0, 0, 8)])]
    (over,) = flat_params(9)
    reducer = BucketReducer([FlatGroup([over], 1, 0)], ONE_RANK, zero_config(8), [over], CPU)
    assert [(b.start, b.end, b.pieces) for b in reducer.buckets] == [(1, 9, [(0, 1, 9)]), (0, 1, [(0, 0, 1)])]
    two = flat_params(4, 4)                      # two parameters filling one bucket exactly
    reducer = BucketReducer([FlatGroup(two, 1, 0)], ONE_RANK, zero_config(8), two, CPU)
    assert [(b.start, b.end, b.pieces) for b in reducer.buckets] == [(0, 8, [(0, 0, 4), (1, 4, 8)])]


def test_example_buckets_and_their_pieces():
    reducer, _ = example()
    assert buckets(reducer) == EXAMPLE_ORDER
    assert [b.pieces for b in reducer.buckets] == [[(1, 8, 12)], [(0, 2, 6)], [(0, 0, 2)], [(0, 4, 5), (1, 5, 8)],
                                                   [(0, 0, 4)]]


@pytest.mark.parametrize("arrival", ["abc", "cba", "bca", "acb"])
def test_launch_order_is_the_bucket_order_whatever_order_gradients_arrive_in(monkeypatch, arrival):
    """Every rank must launch the same collectives in the same order: a bucket complete early waits its turn."""
    reducer, params = example()
    recorder = recorded(monkeypatch, reducer)
    for name in arrival:
        backward(params[name])
    reducer.finish_micro_step(boundary=True)
    assert recorder.events == ["launch " + name for name in EXAMPLE_ORDER]


def test_gradients_in_backward_order_launch_buckets_as_soon_as_they_are_due(monkeypatch):
    """c completes g0[8,12) (g0[4,8) still needs a); b completes both of group 1; a completes the rest."""
    reducer, params = example()
    recorder = recorded(monkeypatch, reducer)
    launched = []
    for name in "cba":
        backward(params[name])
        launched.append(len(recorder.events))
    assert launched == [1, 3, 5]


TIMELINES = {   # gradients c, b, a (backward order); hand-traced from _launch's "complete the oldest beyond the bound"
    1: ["launch g0[8,12)", "launch g1[2,6)", "wait g0[8,12)", "launch g1[0,2)", "wait g1[2,6)", "launch g0[4,8)",
        "wait g1[0,2)", "launch g0[0,4)", "wait g0[4,8)", "wait g0[0,4)"],
    2: ["launch g0[8,12)", "launch g1[2,6)", "launch g1[0,2)", "wait g0[8,12)", "launch g0[4,8)", "wait g1[2,6)",
        "launch g0[0,4)", "wait g1[0,2)", "wait g0[4,8)", "wait g0[0,4)"],
}


@pytest.mark.parametrize("max_in_flight", sorted(TIMELINES))
def test_overlap_keeps_at_most_max_in_flight_reductions_and_waits_oldest_first(monkeypatch, max_in_flight):
    monkeypatch.setattr(bucketing, "MAX_IN_FLIGHT", max_in_flight)
    reducer, params = example(overlap=True)
    recorder = recorded(monkeypatch, reducer)
    for name in "cba":
        backward(params[name])
        assert len(reducer.in_flight) <= max_in_flight
    reducer.finish_micro_step(boundary=True)
    assert recorder.events == TIMELINES[max_in_flight]
    assert max(recorder.outstanding_at_launch) == max_in_flight and recorder.outstanding == 0


def test_overlap_bound_is_the_modules_max_in_flight(monkeypatch):
    """With the real MAX_IN_FLIGHT and more buckets than it: the bound is reached, never passed."""
    params = flat_params(*[3] * (bucketing.MAX_IN_FLIGHT + 3))
    reducer = BucketReducer([FlatGroup(params, 1, 0)], ONE_RANK, zero_config(3, overlap=True), params, CPU)
    recorder = recorded(monkeypatch, reducer)
    for param in reversed(params):
        backward(param)
    reducer.finish_micro_step(boundary=True)
    assert max(recorder.outstanding_at_launch) == bucketing.MAX_IN_FLIGHT and recorder.outstanding == 0


def test_without_overlap_each_reduction_completes_before_the_next_launch(monkeypatch):
    reducer, params = example(overlap=False)
    recorder = recorded(monkeypatch, reducer)
    for name in "cba":
        backward(params[name])
        assert reducer.in_flight == []
    reducer.finish_micro_step(boundary=True)
    assert recorder.outstanding_at_launch == [0] * 5


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("arrival", ["cba", "abc"])
def test_partition_gradient_is_the_sum_of_gradients_and_a_missing_one_counts_zero(contiguous, arrival):
    """dp 1 (the real reduce_range, no communication): each group's partition gradient is its parameters'
    gradients in flat order, padded with zeros; over two micro-steps they add; a parameter without a gradient
    in a backward (b in the second) contributes zero there."""
    reducer, params = example(contiguous=contiguous)
    for name in arrival:
        backward(params[name], scale=1.0)
    reducer.finish_micro_step(boundary=False)
    for name in arrival.replace("b", ""):
        backward(params[name], scale=2.0)
    reducer.finish_micro_step(boundary=True)
    a, b, c = params["a"], params["b"], params["c"]
    group0 = torch.cat([gradient(a, 1) + gradient(a, 2), gradient(c, 1) + gradient(c, 2), torch.zeros(32 - 12)])
    group1 = torch.cat([gradient(b, 1), torch.zeros(32 - 6)])
    assert torch.equal(reducer.partition_grad(0), group0)
    assert torch.equal(reducer.partition_grad(1), group1)
    assert all(p.grad is None for p in params.values())          # the hook drops param.grad


def test_a_second_gradient_after_its_bucket_was_reduced_is_an_error():
    reducer, params = example()
    backward(params["c"])                              # launches g0[8,12)
    with pytest.raises(RuntimeError, match="received a second gradient after its bucket was reduced"):
        backward(params["c"])


@pytest.mark.parametrize("numel, chunks", [(8, ["g0[0,8)"]), (9, ["g0[0,8)", "g0[8,9)"]),
                                           (17, ["g0[0,8)", "g0[8,16)", "g0[16,17)"])])
def test_boundary_reducer_chunks_at_the_bucket_size(monkeypatch, numel, chunks):
    """Stages 0-1: one reduction per bucket_size chunk of the unpadded flat gradient, only at the boundary."""
    params = flat_params(numel)
    groups = [FlatGroup(params, 1, 0)]
    reducer = BoundaryReducer(groups, ONE_RANK, 1, zero_config(8))
    recorder = recorded(monkeypatch, reducer)
    reducer.finish_micro_step(boundary=False)
    assert recorder.events == []
    reducer.finish_micro_step(boundary=True)
    assert recorder.events == ["launch " + chunk for chunk in chunks] + ["wait " + chunk for chunk in chunks]


@pytest.mark.parametrize("contiguous", [True, False])
def test_offloaded_partitions_reduce_on_the_compute_device(contiguous):
    """offload_param (ZeRO-3's partitions in host memory) and offload_optimizer: the buckets that go into the
    reductions are filled on the compute device (NCCL takes device tensors only), never on the partitions' host;
    the reduced partition gradients are host offload memory. "meta" stands in for the accelerator."""
    from megatron.zero import offload
    from megatron.zero.stage3 import PartitionedGroup
    params = flat_params(5, 7)
    group = PartitionedGroup(params, 1, 0, lambda p: p.data, torch.float32, offload.HOST, offloaded=True)
    for gradient_device in (None, offload.HOST):       # offload_param alone, and with offload_optimizer
        reducer = BucketReducer([group], ONE_RANK, zero_config(4, contiguous=contiguous), params,
                                torch.device("meta"), gradient_device=gradient_device)
        assert reducer.store.device == torch.device("meta")
        assert offload.is_host_offload(reducer.partition_grad(0))


@pytest.mark.parametrize("offload, pinned", [({}, False), ({"offload_optimizer": {"device": "cpu"}}, False),
                                             ({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, True),
                                             ({"offload_param": {"device": "cpu", "pin_memory": True}}, True),
                                             ({"offload_optimizer": {"device": "none", "pin_memory": True}}, False)])
def test_host_gradient_partitions_are_pinned_as_the_offload_block_asks(monkeypatch, offload, pinned):
    """The reduced-gradient partitions in host memory are page-locked when an enabled offload block says pin_memory
    (DeepSpeed's rule; on CUDA an unpinned partition makes each reduced piece's copy to the host a blocking one).
    Asserted at the request: offload.host_zeros' pin_memory (this CPU has no pinned memory to look at)."""
    from megatron.zero import config_schema, offload as offload_memory
    requests = []
    real = offload_memory.host_zeros
    monkeypatch.setattr(offload_memory, "host_zeros",
                        lambda numel, dtype, pin_memory=False: requests.append(pin_memory) or real(numel, dtype))
    config = ZeroConfig(stage=2, reduce_bucket_size=4,
                        **{key: config_schema.OffloadConfig(**block) for key, block in offload.items()})
    params = flat_params(5, 6)
    BucketReducer([FlatGroup(params[:1], 1, 0), FlatGroup(params[1:], 1, 0)], ONE_RANK, config, params, CPU,
                  gradient_device=CPU if offload else None)
    assert requests == ([pinned, pinned] if offload else [])
