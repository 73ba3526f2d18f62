"""The 1F1B schedule as data (no processes): per-stage order of forwards and backwards, the activation-memory
bound, and that the stages' orders together run to completion with blocking sends and receives; then the executor
itself on two gloo processes follows that order."""
import pytest
import torch

from megatron.pipeline.schedules import num_warmup_micro_batches, pipeline_order


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


class _Stage(torch.nn.Module):
    """One linear layer per stage; the last stage's output is a scalar loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor


def _executed_orders(num_micro_batches):
    """The executor's own order of forwards and backwards on this stage of a 2-stage gloo pipeline."""
    import mpu
    from megatron.pipeline import p2p_communication, schedules
    mpu.initialize_model_parallel(1, 2)
    model, trace = _Stage(), []
    batches = iter([torch.full((2, 3, 4), float(i)) for i in range(num_micro_batches)])

    def forward_step(iterator, module):
        x = next(iterator) if mpu.is_pipeline_first_stage() else module.input_tensor
        out = module.linear(x)
        return (out.square().mean(), {"loss": 0.0}) if mpu.is_pipeline_last_stage() else (out, {})

    def backward(output, output_grad, index, after_backward):
        torch.autograd.backward(output, output_grad)
        after_backward()
    spec = p2p_communication.TensorSpec((2, 3, 4), torch.float32, torch.device("cpu"))
    losses = schedules.get_forward_backward_func()(forward_step, batches, model, backward, num_micro_batches, spec,
                                                   trace=trace)
    return mpu.get_pipeline_model_parallel_rank(), trace, len(losses)


def test_executor_runs_the_pure_order_on_two_processes():
    from megatron.spawn import run_distributed
    results = run_distributed(_executed_orders, 2, args=(4,))
    for stage, trace, num_losses in results:
        assert trace == pipeline_order(2, stage, 4)
        assert num_losses == (4 if stage == 1 else 0)
