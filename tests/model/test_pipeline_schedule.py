"""The 1F1B schedule as data (no processes): per-stage order of forwards and backwards, the activation-memory
bound, and that the stages' orders together run to completion with blocking sends and receives; then the executor
itself on two gloo processes follows that order. The same for the interleaved schedule (Megatron-LM's orders,
warmup counts, chunk and micro-batch of each forward, layer-to-chunk assignment, bubble (P - 1) / (v M) in the
simulation, and its executor on two processes). The interleaved executor's point-to-point exchanges are also
recorded stage by stage in one process and matched across stages: a wrong receive flag, a hang until the process
group's timeout on gloo, fails there in milliseconds naming the stage, the exchange and the message it waits for."""
import pytest
import torch

from megatron.pipeline.schedules import (forwards_in_flight, interleaved_order, interleaving_error, micro_batch_id,
                                       model_chunk_id, num_warmup_micro_batches, pipeline_order)


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


def _toy_forward_step(iterator, module):
    """The schedules' forward step for _Stage: the batch on the first stage, the received tensor elsewhere."""
    import mpu
    x = next(iterator) if mpu.is_pipeline_first_stage() else module.input_tensor
    out = module.linear(x)
    return (out.square().mean(), {"loss": 0.0}) if mpu.is_pipeline_last_stage() else (out, {})


def _toy_backward(output, output_grad, index, after_backward):
    torch.autograd.backward(output, output_grad)
    after_backward()


def _executed_orders(num_micro_batches):
    """The executor's own order of forwards and backwards on this stage of a 2-stage gloo pipeline."""
    import mpu
    from megatron.pipeline import p2p_communication, schedules
    mpu.initialize_model_parallel(1, 2)
    model, trace = _Stage(), []
    batches = iter([torch.full((2, 3, 4), float(i)) for i in range(num_micro_batches)])
    spec = p2p_communication.TensorSpec((2, 3, 4), torch.float32, torch.device("cpu"))
    losses = schedules.get_forward_backward_func()(_toy_forward_step, batches, model, _toy_backward,
                                                   num_micro_batches, spec, trace=trace)
    return mpu.get_pipeline_model_parallel_rank(), trace, len(losses)


def test_executor_runs_the_pure_order_on_two_processes():
    from megatron.spawn import run_distributed
    results = run_distributed(_executed_orders, 2, args=(4,))
    for stage, trace, num_losses in results:
        assert trace == pipeline_order(2, stage, 4)
        assert num_losses == (4 if stage == 1 else 0)


# ---- interleaved 1F1B (v model chunks per stage) --------------------------------------------------------------

def _chunked_text(order):
    return [f"{kind}{index}.{chunk}" for kind, index, chunk in order]


def test_interleaved_literal_orders_p2_v2():
    """Megatron-LM's interleaved order written out (F1.0: forward of micro-batch 1 on chunk 0): groups of P
    micro-batches per chunk, warmup 2 (P - s - 1) + (v - 1) P, all forwards first when M = P."""
    assert _chunked_text(interleaved_order(2, 0, 4, 2)) == \
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0".split()
    assert _chunked_text(interleaved_order(2, 1, 4, 2)) == \
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0".split()
    for stage in (0, 1):
        assert _chunked_text(interleaved_order(2, stage, 2, 2)) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0".split()


@pytest.mark.parametrize("num_stages,num_micro_batches,warmups", [
    (2, 4, [4, 2]), (2, 2, [4, 4]), (4, 8, [10, 8, 6, 4]), (4, 4, [8, 8, 8, 8]), (4, 16, [10, 8, 6, 4])])
def test_interleaved_warmup_counts(num_stages, num_micro_batches, warmups):
    assert [num_warmup_micro_batches(num_stages, s, num_micro_batches, 2) for s in range(num_stages)] == warmups


@pytest.mark.parametrize("num_stages,num_chunks", [(2, 2), (4, 2), (2, 3)])
def test_interleaved_micro_batch_and_chunk_of_each_forward(num_stages, num_chunks):
    """Forward k: chunk (k mod Pv) div P, micro-batch (k div Pv) P + k mod P; backward k: the chunks reversed."""
    group = num_stages * num_chunks
    for k in range(3 * group):
        assert micro_batch_id(k, num_stages, num_chunks) == k // group * num_stages + k % num_stages
        assert model_chunk_id(k, num_stages, num_chunks, True) == k % group // num_stages
        assert model_chunk_id(k, num_stages, num_chunks, False) == num_chunks - 1 - k % group // num_stages
    assert [model_chunk_id(k, 4, 2, True) for k in range(10)] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert [micro_batch_id(k, 4, 2) for k in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


def _simulate_interleaved(num_stages, num_micro_batches, num_chunks):
    """_simulate on the ring: F(i, c) on stage 0 needs F(i, c - 1) on the last stage, B(i, c) on the last stage
    needs B(i, c + 1) on stage 0. Returns the time steps taken (chunk forward = backward = 1 step)."""
    orders = [interleaved_order(num_stages, s, num_micro_batches, num_chunks) for s in range(num_stages)]
    done = [set() for _ in range(num_stages)]
    position, steps, last = [0] * num_stages, 0, num_stages - 1
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        ready = []
        for s in range(num_stages):
            if position[s] == len(orders[s]):
                continue
            kind, i, c = orders[s][position[s]]
            if kind == "F":
                need = (s - 1, ("F", i, c)) if s > 0 else (last, ("F", i, c - 1)) if c > 0 else None
            else:
                need = (s + 1, ("B", i, c)) if s < last else (0, ("B", i, c + 1)) if c < num_chunks - 1 else None
            if need is None or need[1] in done[need[0]]:
                ready.append(s)
        if not ready:
            raise AssertionError(f"deadlock after {steps} steps at positions {position}")
        for s in ready:
            done[s].add(orders[s][position[s]])
            position[s] += 1
        steps += 1
    return steps


@pytest.mark.parametrize("num_stages,num_chunks,num_micro_batches", [
    (2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (2, 3, 4), (4, 3, 8)])
def test_interleaved_orders_run_together_and_bubble(num_stages, num_chunks, num_micro_batches):
    """Every chunk of every micro-batch forward once and backward once, backward after forward; the stages' orders
    run together on the ring in 2 (v M + P - 1) chunk steps: bubble (P - 1) / (v M) of the 2 v M busy steps."""
    P, v, M = num_stages, num_chunks, num_micro_batches
    for stage in range(P):
        order = interleaved_order(P, stage, M, v)
        ops = [(i, c) for i in range(M) for c in range(v)]
        assert sorted(order) == sorted([("F", i, c) for i, c in ops] + [("B", i, c) for i, c in ops])
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) for i, c in ops)
    assert _simulate_interleaved(P, M, v) == 2 * (v * M + P - 1)


@pytest.mark.parametrize("num_stages,num_micro_batches", [(2, 4), (4, 8), (4, 16)])
def test_interleaved_activation_memory_bound(num_stages, num_micro_batches):
    """Stage s holds at most forwards_in_flight chunk forwards; on stage 0 that is Megatron-LM's
    L (1 + (P - 1) / (P v)) layers' worth (chunks of L / (P v) layers), at v = 2."""
    P, v, L = num_stages, 2, 8
    for stage in range(P):
        order = interleaved_order(P, stage, num_micro_batches, v)
        assert _max_in_flight([op[:2] for op in order]) == forwards_in_flight(P, stage, num_micro_batches, v)
    assert forwards_in_flight(P, 0, num_micro_batches, v) * L // (P * v) == L * (1 + (P - 1) / (P * v))


def test_interleaving_error_is_megatron_lms():
    assert interleaving_error(8, 4) is None
    assert interleaving_error(6, 4) == ("number of microbatches (6) is not divisible by pipeline-model-parallel-size "
                                        "(4) when using interleaved schedule")


def test_layer_ranges_are_megatron_lms_assignment():
    """Chunk c of stage r holds layers [(c P + r) n, (c P + r + 1) n), n = L / (P v)."""
    from mpu import pipeline_layer_ranges
    assert [pipeline_layer_ranges(8, 2, r, 2) for r in range(2)] == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert [pipeline_layer_ranges(8, 4, r, 2) for r in range(4)] == [[(0, 1), (4, 5)], [(1, 2), (5, 6)],
                                                                     [(2, 3), (6, 7)], [(3, 4), (7, 8)]]
    assert [pipeline_layer_ranges(12, 2, r, 3) for r in range(2)] == [[(0, 2), (4, 6), (8, 10)],
                                                                      [(2, 4), (6, 8), (10, 12)]]
    assert [pipeline_layer_ranges(8, 2, r) for r in range(2)] == [[(0, 4)], [(4, 8)]]     # v = 1: contiguous
    with pytest.raises(ValueError, match=r"num_layers \(6\) is not divisible by the pipeline size \(2\) x model "
                                         r"chunks per stage \(2\)"):
        pipeline_layer_ranges(6, 2, 0, 2)


def _executed_interleaved_orders(cases):
    """The interleaved executor's own order on this stage of a 2-stage gloo pipeline with 2 chunks, for each M of
    `cases`, and which micro-batch (by its data) each chunk's forward read."""
    import mpu
    from megatron.pipeline import p2p_communication, schedules
    mpu.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    model, found = _Stage(), {}
    for num_micro_batches in cases:
        batches = iter([torch.full((2, 3, 4), float(i)) for i in range(num_micro_batches)])
        trace, read = [], []

        def forward_step(iterator, module):
            x = next(iterator)
            read.append((mpu.get_virtual_pipeline_model_parallel_rank(), int(x[0, 0, 0])))
            x = x if mpu.is_pipeline_first_stage() else module.input_tensor
            out = module.linear(x)
            return (out.square().mean(), {"loss": 0.0}) if mpu.is_pipeline_last_stage() else (out, {})

        def backward(output, output_grad, index, after_backward):
            torch.autograd.backward(output, output_grad)
            after_backward()
        spec = p2p_communication.TensorSpec((2, 3, 4), torch.float32, torch.device("cpu"))
        losses = schedules.get_forward_backward_func()(forward_step, batches, model, backward, num_micro_batches,
                                                       spec, trace=trace)
        found[num_micro_batches] = (trace, read, len(losses))
    return mpu.get_pipeline_model_parallel_rank(), found


def test_interleaved_executor_runs_the_pure_order_on_two_processes():
    """M = 4 (a steady state) and M = 2 (= P: all forwards first); every chunk's forward reads its own micro-batch
    (the data drawn once, replayed to chunk 1)."""
    from megatron.spawn import run_distributed
    for stage, found in run_distributed(_executed_interleaved_orders, 2, args=((4, 2),)):
        for num_micro_batches, (trace, read, num_losses) in found.items():
            assert trace == interleaved_order(2, stage, num_micro_batches, 2)
            assert read == [(chunk, index) for kind, index, chunk in trace if kind == "F"]
            assert num_losses == (num_micro_batches if stage == 1 else 0)


# ---- the interleaved executor's exchanges, matched without processes (a mismatch fails here in milliseconds; on
# gloo it is a hang until the process group's timeout) --------------------------------------------------------

def _recorded_exchanges(monkeypatch, num_stages, num_chunks, num_micro_batches, forward_only):
    """Run the real interleaved executor once per stage in this process, with mpu's pipeline state set for that
    stage and p2p_communication._communicate replaced by a recorder: ({stage: [exchange]}, {stage: trace}); an
    exchange is a list of (direction, peer stage, tag) with direction "send" or "recv" (tags as p2p's)."""
    import mpu
    import mpu.initialize as state
    from megatron.pipeline import p2p_communication as p2p
    from megatron.pipeline import schedules
    stage_now, exchanges = [0], []
    monkeypatch.setattr(state, "_PIPELINE_RANKS", list(range(num_stages)))
    monkeypatch.setattr(state, "_VIRTUAL_PIPELINE_WORLD_SIZE", num_chunks)
    monkeypatch.setattr(state, "_VIRTUAL_PIPELINE_RANK", 0)
    monkeypatch.setattr(state.dist, "get_rank", lambda *args, **kwargs: stage_now[0])

    def communicate(spec, send_next=None, send_previous=None, recv_previous=False, recv_next=False):
        s, P = stage_now[0], num_stages
        previous, following = (s - 1) % P, (s + 1) % P
        ops = [("recv", previous, p2p._ACTIVATION_TAG)] * recv_previous + \
            [("send", following, p2p._ACTIVATION_TAG)] * (send_next is not None) + \
            [("recv", following, p2p._GRADIENT_TAG)] * recv_next + \
            [("send", previous, p2p._GRADIENT_TAG)] * (send_previous is not None)
        if ops:
            exchanges.append(ops)
        received = torch.zeros(spec.shape, requires_grad=True) if recv_previous else None
        return received, (torch.ones(spec.shape) if recv_next else None)
    monkeypatch.setattr(p2p, "_communicate", communicate)
    spec = p2p.TensorSpec((2, 3, 4), torch.float32, torch.device("cpu"))
    model = _Stage()
    found, traces, errors = {}, {}, {}
    for stage in range(num_stages):
        stage_now[0], exchanges, traces[stage] = stage, [], []
        batches = iter([torch.full((2, 3, 4), float(i)) for i in range(num_micro_batches)])
        try:        # a receive that would hang on gloo gets a made-up tensor here: what follows may fail
            schedules.forward_backward_pipelining_with_interleaving(
                _toy_forward_step, batches, model, _toy_backward, num_micro_batches, spec, forward_only=forward_only,
                trace=traces[stage])
        except Exception as error:        # reported after the exchanges are matched (the cause, if a hang)
            errors[stage] = error
        found[stage] = exchanges
    return found, traces, errors


def _run_exchanges(exchanges):
    """Play every stage's exchanges together as p2p does (each posts all its sends and receives, then waits for
    all): the k-th send on a (source, destination, tag) channel meets the k-th receive. Raises AssertionError naming
    the stage, its exchange and the message it waits for where gloo would hang."""
    kinds = {1: "activation", 2: "gradient"}
    where, ops_of = {}, {}      # (source, destination, tag, k, "send" | "recv") -> (stage, exchange index)
    for stage, ops_list in exchanges.items():
        counts = {}
        for index, ops in enumerate(ops_list):
            for direction, peer, tag in ops:
                channel = (stage, peer, tag) if direction == "send" else (peer, stage, tag)
                k = counts[channel, direction] = counts.get((channel, direction), -1) + 1
                where[channel + (k, direction)] = (stage, index)
                ops_of.setdefault((stage, index), []).append(channel + (k, direction))

    def waiting(stage, index, position):
        """What exchange `index` of `stage` still waits for ([] when it can complete now)."""
        found = []
        for source, destination, tag, k, direction in ops_of[stage, index]:
            what = f"{'sends' if direction == 'send' else 'receives'} {kinds[tag]} #{k} " + \
                (f"to stage {destination}" if direction == "send" else f"from stage {source}")
            peer = where.get((source, destination, tag, k, "recv" if direction == "send" else "send"))
            if peer is None:
                found.append(f"{what}, which stage {destination if direction == 'send' else source} never "
                             f"{'receives' if direction == 'send' else 'sends'}")
            elif position[peer[0]] < peer[1]:
                found.append(f"{what}, matched only in stage {peer[0]}'s exchange #{peer[1]}")
        return found
    position = {stage: 0 for stage in exchanges}
    while any(position[s] < len(exchanges[s]) for s in exchanges):
        stuck = {s: waiting(s, i, position) for s, i in position.items() if i < len(exchanges[s])}
        ready = [s for s, waits in stuck.items() if not waits]
        if not ready:
            raise AssertionError("the pipeline would hang: " + "; ".join(
                f"stage {s} in exchange #{position[s]} {waits[0]}" for s, waits in stuck.items()))
        for stage in ready:
            position[stage] += 1


@pytest.mark.parametrize("num_stages,num_chunks,num_micro_batches", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 3, 4),
                                                                     (4, 3, 4)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_interleaved_executor_exchanges_match_across_stages(monkeypatch, num_stages, num_chunks, num_micro_batches,
                                                            forward_only):
    """Every send of the executor meets a receive of the neighbour in an exchange both reach: the stages' exchanges
    run to the end together (a wrong recv_prev / recv_next flag fails here with the stage, exchange and message,
    instead of a hang); each stage's own order is interleaved_order's."""
    exchanges, traces, errors = _recorded_exchanges(monkeypatch, num_stages, num_chunks, num_micro_batches,
                                                    forward_only)
    try:
        _run_exchanges(exchanges)
    except AssertionError as hang:
        raise AssertionError(f"{hang}" + "".join(f"; then stage {s} failed: {e!r}" for s, e in errors.items()))
    assert not errors, errors
    for stage, trace in traces.items():
        expected = interleaved_order(num_stages, stage, num_micro_batches, num_chunks)
        assert trace == ([op for op in expected if op[0] == "F"] if forward_only else expected), stage
