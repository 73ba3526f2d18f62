"""The 1F1B schedule as data (no processes): per-stage order of forwards and backwards, the activation-memory
bound, and that the stages' orders together run to completion with blocking sends and receives."""
import pytest

from megatron.schedules import num_warmup_micro_batches, pipeline_order


def _expected(num_stages, stage, num_micro_batches):
    """1F1B written out independently: warmup forwards, then F/B pairs, then the remaining backwards."""
    warmup = min(num_stages - 1 - stage, num_micro_batches)
    order = [f"F{i}" for i in range(warmup)]
    for j in range(num_micro_batches - warmup):
        order += [f"F{warmup + j}", f"B{j}"]
    return order + [f"B{j}" for j in range(num_micro_batches - warmup, num_micro_batches)]


def _text(order):
    return [f"{kind}{index}" for kind, index in order]


def test_literal_orders_p2_m4_and_p4_m4():
    assert _text(pipeline_order(2, 0, 4)) == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    assert _text(pipeline_order(2, 1, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3".split()
    assert _text(pipeline_order(4, 0, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3".split()
    assert _text(pipeline_order(4, 1, 4)) == "F0 F1 F2 B0 F3 B1 B2 B3".split()
    assert _text(pipeline_order(4, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3".split()


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("num_micro_batches", [4, 8])
def test_order_per_stage(num_stages, num_micro_batches):
    for stage in range(num_stages):
        order = pipeline_order(num_stages, stage, num_micro_batches)
        assert _text(order) == _expected(num_stages, stage, num_micro_batches)
        assert num_warmup_micro_batches(num_stages, stage, num_micro_batches) == num_stages - 1 - stage
        # every micro-batch forward once, backward once, backward after its forward, backwards in order
        assert sorted(order) == sorted([("F", i) for i in range(num_micro_batches)] +
                                       [("B", i) for i in range(num_micro_batches)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(num_micro_batches))
        assert [i for kind, i in order if kind == "B"] == list(range(num_micro_batches))


def _max_in_flight(order):
    held, peak = 0, 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("num_micro_batches", [4, 8])
def test_activation_memory_bound(num_stages, num_micro_batches):
    """Stage s holds at most P - s micro-batches of activations: stage 0 never more than P (GPipe would hold M)."""
    for stage in range(num_stages):
        peak = _max_in_flight(pipeline_order(num_stages, stage, num_micro_batches))
        assert peak == min(num_stages - stage, num_micro_batches)
    assert _max_in_flight(pipeline_order(num_stages, 0, num_micro_batches)) <= num_stages


def _simulate(num_stages, num_micro_batches):
    """Run every stage's order with Megatron's communication pattern, one op per time step per stage: F(i) on
    stage s needs F(i) done on s - 1, B(i) needs B(i) done on s + 1. Returns the time steps taken, or raises
    if the orders deadlock (a stage waits on something that never comes)."""
    orders = [pipeline_order(num_stages, s, num_micro_batches) for s in range(num_stages)]
    done = [set() for _ in range(num_stages)]
    position, steps = [0] * num_stages, 0
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        ready = []
        for s in range(num_stages):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            need = (s - 1, ("F", i)) if kind == "F" else (s + 1, ("B", i))
            if 0 <= need[0] < num_stages and need[1] not in done[need[0]]:
                continue
            ready.append(s)
        if not ready:
            raise AssertionError(f"deadlock after {steps} steps at positions {position}")
        for s in ready:
            done[s].add(orders[s][position[s]])
            position[s] += 1
        steps += 1
    return steps


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("num_micro_batches", [4, 8])
def test_orders_run_together_and_bubble(num_stages, num_micro_batches):
    """With forward = backward = 1 time step, 1F1B takes 2 (M + P - 1) steps: bubble (P-1)/(M+P-1)."""
    steps = _simulate(num_stages, num_micro_batches)
    assert steps == 2 * (num_micro_batches + num_stages - 1)
