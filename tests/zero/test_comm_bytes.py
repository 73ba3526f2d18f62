"""Bytes sent per rank for one training step, measured by megatron.guards.comm_bytes, against the ideal volumes.

Ideal, for G = fp32 gradient bytes = 4 x parameter count, over dp ranks:
    torch DDP and ZeRO stage 0: one ring all-reduce          2 (dp-1)/dp G
    ZeRO stages 1 and 2: reduce-scatter (each range reduced to its owner) + all-gather of the updated slices,
                         (dp-1)/dp G each, the same total
    ZeRO stage 3:        reduce-scatter + an all-gather before forward and another before backward, 3 (dp-1)/dp G;
                         parameters under stage3_param_persistence_threshold stay whole and are refreshed once
                         after the step instead (WideNet's all are, at the default threshold: 2 (dp-1)/dp G)
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron.guards import comm_bytes
from megatron.guards.comm_bytes import CommCounter, collective_bytes
from megatron.spawn import run_distributed
from tests.helpers import ds_config, param_groups

WIDTH_IN, WIDTH = 32, 512
TOLERANCE = 0.05


class WideNet(nn.Module):
    """Two Linears, ~33k parameters: large enough that the engine's partition padding (< 32 dp elements per
    param group) stays under 1% of the gradient bytes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.fc1, self.fc2 = nn.Linear(WIDTH_IN, WIDTH), nn.Linear(WIDTH, WIDTH_IN)

    def forward(self, x):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), x)


VARIANTS = {
    "ddp": None,
    "stage0": ds_config(0, micro=2),
    "stage1": ds_config(1, micro=2),
    "stage2": ds_config(2, micro=2, reduce_bucket_size=5000),
    "stage2_allreduce": ds_config(2, micro=2, reduce_bucket_size=5000, reduce_scatter=False),
    "stage3": ds_config(3, micro=2, reduce_bucket_size=5000, stage3_param_persistence_threshold=0,
                        stage3_max_reuse_distance=0),
    "stage3_persistent": ds_config(3, micro=2, reduce_bucket_size=5000),
    # fc2 (16384 + 32 elements) ends the forward last: kept for the backward at exactly its size, not one below
    "stage3_reuse_fc2": ds_config(3, micro=2, reduce_bucket_size=5000, stage3_param_persistence_threshold=0,
                                  stage3_max_reuse_distance=WIDTH * WIDTH_IN + WIDTH_IN),
    "stage3_reuse_below": ds_config(3, micro=2, reduce_bucket_size=5000, stage3_param_persistence_threshold=0,
                                    stage3_max_reuse_distance=WIDTH * WIDTH_IN + WIDTH_IN - 1),
    "stage3_reuse_all": ds_config(3, micro=2, reduce_bucket_size=5000, stage3_param_persistence_threshold=0),
}
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast")   # owners -> every rank


def _build(config):
    model = WideNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3)
    if config is None:
        ddp = comm_bytes.count_ddp_allreduce(torch.nn.parallel.DistributedDataParallel(model))

        def step(x):
            optimizer.zero_grad()
            ddp(x).backward()
            optimizer.step()
        return step
    from megatron import zero
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def step(x):
        engine.backward(engine(x))
        engine.step()
    return step


def _measure_one_step(names):
    """{variant: {op: bytes}} for the second step of each variant (the first warms up), on this rank."""
    x = torch.randn(2, WIDTH_IN, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for name in names:
        step = _build(VARIANTS[name])
        step(x)
        with CommCounter() as counter:
            step(x)
        out[name] = dict(counter.bytes_by_op)
    # the counter itself, on a known payload: all-gather of 10 fp32 per rank
    n = dist.get_world_size()
    with CommCounter() as counter:
        dist.all_gather_into_tensor(torch.empty(10 * n), torch.ones(10))
    out["known_all_gather"] = dict(counter.bytes_by_op)
    # point to point as pipelining posts it: each rank sends 10 fp32 to its partner and receives 10 from it
    partner, received = dist.get_rank() ^ 1, torch.zeros(10)
    with CommCounter() as counter:
        ops = [dist.P2POp(dist.isend, torch.full((10,), float(dist.get_rank())), partner),
               dist.P2POp(dist.irecv, received, partner)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    out["known_p2p"] = (dict(counter.bytes_by_op), received[0].item() == partner)
    out["restored"] = dist.all_reduce is comm_bytes.dist.all_reduce and "counted" not in dist.all_reduce.__name__
    out["known_each_op"] = _each_op_on_known_payloads()
    return out


def _each_op_on_known_payloads():
    """{op: bytes counted} for one call of every wrapped collective, each on its own fp32 payload size (so reading
    the wrong argument shows): 3 elements per rank's piece for the scatters and gathers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(5)),
        "reduce": lambda: dist.reduce(torch.ones(6), dst=0),
        "broadcast": lambda: dist.broadcast(torch.ones(7), src=0),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(n)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * n)),
        "all_gather": lambda: dist.all_gather([torch.empty(3) for _ in range(n)], torch.ones(3)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(3 * n), torch.ones(3)),
        "all_gather_single": lambda: dist.all_gather_single(torch.empty(3 * n), torch.ones(3)),
        # even ranks send 8 elements to their partner, odd ranks receive them (receives are not counted)
        "send": lambda: dist.send(torch.ones(8), rank + 1) if rank % 2 == 0 else dist.recv(torch.empty(8), rank - 1),
    }
    counted = {}
    for op, call in calls.items():
        if getattr(dist, op, None) is None:     # all_gather_single: newer torch only
            continue
        with CommCounter() as counter:
            call()
        counted[op] = dict(counter.bytes_by_op)
    return counted


@pytest.fixture(scope="module", params=[2, 4])
def measured(request):
    dp = request.param
    results = run_distributed(_measure_one_step, dp, args=(list(VARIANTS),))
    return dp, results


def _gradient_bytes():
    return 4 * sum(p.numel() for p in WideNet().parameters())


def _close(value, ideal):
    return abs(value - ideal) <= TOLERANCE * ideal


# Every op the counter wraps: bytes one rank sends on B = 1200 payload bytes over n = 2, 3, 4 ranks, worked by hand
# from the ring volumes (all-reduce 2(n-1)/n B; reduce-scatter, all-gather, reduce, broadcast (n-1)/n B; sends B).
HAND_TABLE = {
    "all_reduce": {2: 1200, 3: 1600, 4: 1800},
    "reduce": {2: 600, 3: 800, 4: 900},
    "broadcast": {2: 600, 3: 800, 4: 900},
    "reduce_scatter": {2: 600, 3: 800, 4: 900},
    "reduce_scatter_tensor": {2: 600, 3: 800, 4: 900},
    "all_gather": {2: 600, 3: 800, 4: 900},
    "all_gather_into_tensor": {2: 600, 3: 800, 4: 900},
    "all_gather_single": {2: 600, 3: 800, 4: 900},
    "send": {2: 1200, 3: 1200, 4: 1200},
    "batch_isend_irecv": {2: 1200, 3: 1200, 4: 1200},
}


def test_cost_model_table():
    originals = {op: getattr(dist, op, None) for op in HAND_TABLE}
    with CommCounter():
        wrapped = {op for op in dir(dist) if not op.startswith("_") and callable(getattr(dist, op)) and
                   "counted" in getattr(getattr(dist, op), "__name__", "")}
    assert wrapped == {op for op, original in originals.items() if original is not None}, wrapped
    for op, by_size in HAND_TABLE.items():
        for n, sent in by_size.items():
            assert collective_bytes(op, 1200, n) == pytest.approx(sent, rel=1e-12), (op, n)
        assert collective_bytes(op, 1200, 1) == 0, op                 # a group of one sends nothing


def test_counter_counts_a_known_collective_and_restores(measured):
    dp, results = measured
    for rank, rank_result in enumerate(results):
        assert rank_result["known_all_gather"] == {"all_gather_into_tensor": (dp - 1) * 10 * 4}
        assert rank_result["known_p2p"] == ({"batch_isend_irecv": 10 * 4}, True)
        assert rank_result["restored"]
        # the same ops by hand, in bytes: all-reduce 2(n-1)/n x 20; reduce 24 and broadcast 28 times (n-1)/n;
        # the scatters' input and the gathers' output are n x 12 bytes, times (n-1)/n; a send its 32 bytes
        piece_ops = ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                     "all_gather_single")
        expected = {"all_reduce": 2 * (dp - 1) * 20 / dp, "reduce": (dp - 1) * 24 / dp,
                    "broadcast": (dp - 1) * 28 / dp, **{op: (dp - 1) * 12 for op in piece_ops}}
        for op, counted in rank_result["known_each_op"].items():
            if op == "send":
                assert counted == ({"send": 32} if rank % 2 == 0 else {}), counted
            else:
                assert counted.keys() == {op} and counted[op] == pytest.approx(expected[op], rel=1e-12), \
                    (op, counted, expected[op])
        assert set(rank_result["known_each_op"]) >= set(HAND_TABLE) - {"all_gather_single", "batch_isend_irecv"}


@pytest.mark.parametrize("name", ["ddp", "stage0"])
def test_data_parallel_sends_one_ring_all_reduce(measured, name):
    dp, results = measured
    ideal = 2 * (dp - 1) / dp * _gradient_bytes()
    for rank_result in results:
        sent = rank_result[name]
        assert _close(sent.get("all_reduce", 0), ideal), (name, sent, ideal)
        assert _close(sum(sent.values()), ideal), (name, sent, ideal)


@pytest.mark.parametrize("name", ["stage1", "stage2"])
def test_partitioned_stages_send_reduce_scatter_plus_all_gather(measured, name):
    dp, results = measured
    half = (dp - 1) / dp * _gradient_bytes()
    for rank_result in results:
        sent = rank_result[name]
        gathered = sum(value for op, value in sent.items() if op in GATHERS)
        assert _close(sent.get("reduce", 0) + sent.get("reduce_scatter_tensor", 0), half), (name, sent, half)
        assert _close(gathered, half), (name, sent, half)
        assert _close(sum(sent.values()), 2 * half), (name, sent, 2 * half)


def test_the_check_can_fail_stage2_all_reduce_is_over_the_ideal(measured):
    """reduce_scatter=False all-reduces every bucket: 2 (dp-1)/dp G, then still all-gathers: 1.5x the ideal."""
    dp, results = measured
    ideal = 2 * (dp - 1) / dp * _gradient_bytes()
    sent = sum(results[0]["stage2_allreduce"].values())
    assert not _close(sent, ideal)
    assert _close(sent, 1.5 * ideal)


@pytest.mark.parametrize("name,gathers", [("stage3", 2), ("stage3_persistent", 1)])
def test_stage3_gathers_before_forward_and_backward(measured, name, gathers):
    """Every parameter partitioned: gathered twice per step; all of WideNet under the default persistence
    threshold: whole on every rank, refreshed once after the step."""
    dp, results = measured
    half = (dp - 1) / dp * _gradient_bytes()
    for rank_result in results:
        sent = rank_result[name]
        assert WideNet().fc1.weight.numel() < 100_000           # the default threshold keeps it whole
        assert _close(sent.get("reduce", 0) + sent.get("reduce_scatter_tensor", 0), half), (name, sent, half)
        assert _close(sum(value for op, value in sent.items() if op in GATHERS), gathers * half), (name, sent)
        assert _close(sum(sent.values()), (1 + gathers) * half), (name, sent)


@pytest.mark.parametrize("name,backward_gathered", [("stage3_reuse_below", ("fc1", "fc2")),
                                                    ("stage3_reuse_fc2", ("fc1",)), ("stage3_reuse_all", ())])
def test_stage3_reuse_skips_the_backward_gather_of_the_units_kept(measured, name, backward_gathered):
    """stage3_max_reuse_distance: the last units of the forward stay gathered into the backward, so the backward
    gathers only the others; the default (1e9) keeps all of WideNet: gathered once per step, as stage 2."""
    dp, results = measured
    model = WideNet()
    numel = {unit: sum(p.numel() for p in getattr(model, unit).parameters()) for unit in ("fc1", "fc2")}
    forward = (dp - 1) / dp * _gradient_bytes()
    backward = (dp - 1) / dp * 4 * sum(numel[unit] for unit in backward_gathered)
    for rank_result in results:
        sent = rank_result[name]
        assert _close(sum(value for op, value in sent.items() if op in GATHERS), forward + backward), (name, sent)


def _gather_pieces_both_ways():
    """{(strategy, layout): (every rank's pieces arrived, bytes this rank sent)} for gather_equal_pieces."""
    from megatron.zero.collectives import gather_equal_pieces
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for per_owner_broadcast in (True, False):
        for layout in ("contiguous", "strided"):
            buffer = torch.zeros(n * 6)
            if layout == "contiguous":      # one bucket: the pieces tile the buffer
                pieces = list(buffer.view(n, 6))
            else:                           # a second bucket: the first 4 of each 6, not adjacent
                pieces = [buffer[r * 6: r * 6 + 4] for r in range(n)]
            pieces[rank].copy_(torch.arange(4.0 if layout == "strided" else 6.0) + 100 * rank)
            with CommCounter() as counter:
                gather_equal_pieces(pieces, None, per_owner_broadcast=per_owner_broadcast)
            arrived = all(torch.equal(piece, torch.arange(float(piece.numel())) + 100 * r)
                          for r, piece in enumerate(pieces))
            out[per_owner_broadcast, layout] = arrived, counter.total_bytes()
    return out


def test_gather_equal_pieces_broadcasts_and_all_gather_agree():
    """The engine's parameter all-gather (stages 1/2): per-owner broadcasts (gloo) and the all-gather (NCCL)
    deliver every piece to every rank and send the same bytes, (n-1)/n of the gathered buffer."""
    for rank_result in run_distributed(_gather_pieces_both_ways, 4):
        for (per_owner_broadcast, layout), (arrived, sent) in rank_result.items():
            assert arrived, (per_owner_broadcast, layout)
            gathered = 4 * 4 * (6 if layout == "contiguous" else 4)
            assert sent == pytest.approx(3 / 4 * gathered), (per_owner_broadcast, layout, sent)
