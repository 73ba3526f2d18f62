"""Rule 4 of the NCCL-rules mode (megatron/guards/p2p_order.py): point-to-point operations pair per peer in
posting order, each waiting for those posted before it with the same peer (or any blocking one), as on NCCL.

- The model alone, on hand-written posting orders: the context-parallel ring's exchange at C = 2 split into a send
  then a receive on both ranks hangs (blocking calls, and lone isend/irecv too: one NCCL stream per peer), as does a
  blocking split ring of 4 ranks; the batched exchange, the even/odd order, and lone isend/irecv at a ring of 4 (other
  peers, other streams) complete; a pair that differs in size or in tag (NCCL ignores tags) is refused.
- Two gloo processes under the rules (tests/conftest.py turns them on for spawned workers): the split exchange, which
  would hang gloo, fails by name on both ranks; the batched one and the even/odd one pass."""
import pytest

from megatron.guards.p2p_order import describe_cycle, P2PModel, P2POrderError
from megatron.spawn import run_distributed

F32 = "torch.float32"


def _send(peer, ordinal=0, numel=8, tag=0):
    return ("send", peer, ordinal, numel, F32, tag)


def _recv(peer, ordinal=0, numel=8, tag=0):
    return ("recv", peer, ordinal, numel, F32, tag)


def _model(posts):
    """posts: [(rank, ops, blocking)] in the order they reach the store."""
    model = P2PModel()
    for rank, ops, blocking in posts:
        model.add(rank, ops, blocking)
    model.settle()
    return model


@pytest.mark.parametrize("blocking", [True, False], ids=["send-recv", "isend-irecv"])
def test_the_split_ring_exchange_at_2_hangs(blocking):
    model = _model([(0, [_send(1)], blocking), (1, [_send(0)], blocking),
                    (0, [_recv(1)], blocking), (1, [_recv(0)], blocking)])
    cycle = model.cycle()
    assert cycle is not None and not model.complete(0, 0) and not model.complete(1, 0)
    text = describe_cycle(cycle)
    assert "send to rank 1 (#1 that way) waits for its match in rank 1's" in text, text
    assert "queued behind rank" in text


def test_blocked_hosts_close_the_cycle_before_the_receives_are_posted():
    """gloo's blocking send holds the host: neither receive is ever posted. Both ranks blocked in their send is a
    cycle; one rank blocked, the other not (it may still post its receive), is not yet."""
    model = _model([(0, [_send(1)], True), (1, [_send(0)], True)])
    assert model.cycle() is None
    assert model.cycle(blocked={1: 0}) is None
    assert model.cycle(blocked={0: 0, 1: 0}) is not None


def test_a_blocking_split_ring_of_4_hangs_and_lone_isends_to_other_peers_do_not():
    ring = [(r, [_send((r + 1) % 4)], True) for r in range(4)]
    assert _model(ring).cycle(blocked={r: 0 for r in range(4)}) is not None
    posts = [(r, [_send((r + 1) % 4)], False) for r in range(4)] + \
            [(r, [_recv((r - 1) % 4)], False) for r in range(4)]
    model = _model(posts)
    assert model.cycle() is None and all(model.complete(r, i) for r in range(4) for i in (0, 1))


def test_the_batched_exchange_and_the_even_odd_order_complete():
    batched = _model([(0, [_send(1), _recv(1)], False), (1, [_send(0), _recv(0)], False)])
    assert batched.cycle() is None and batched.complete(0, 0) and batched.complete(1, 0)
    even_odd = _model([(0, [_send(1)], True), (1, [_recv(0)], True), (1, [_send(0)], True), (0, [_recv(1)], True)])
    assert even_odd.cycle() is None and all(even_odd.complete(r, i) for r in (0, 1) for i in (0, 1))
    # in posting order per peer: rank 0's second send pairs with rank 1's second receive, whatever came between
    twice = _model([(0, [_send(1, 0)], False), (0, [_send(1, 1, numel=3)], False), (1, [_recv(0, 0)], False),
                    (1, [_recv(0, 1, numel=3)], False)])
    assert twice.complete(0, 1) and twice.complete(1, 1)


@pytest.mark.parametrize("theirs,what", [(_recv(0, numel=9), "9 x torch.float32 tag 0 against 8 x"),
                                         (_recv(0, tag=2), "8 x torch.float32 tag 2 against 8 x torch.float32 tag 0")])
def test_a_pair_that_differs_in_size_or_tag_is_refused(theirs, what):
    with pytest.raises(P2POrderError, match=rf"rank 1's recv from rank 0 \(#1 that way\) pairs .* with rank 0's "
                                            rf"send to rank 1 \(#1 that way\): {what}"):
        _model([(0, [_send(1)], False), (1, [theirs], False)])


def _exchange(order):
    """Rank r and 1 - r swap 8 floats: 'split' (each sends, then receives: blocking), 'even-odd' (rank 0 sends
    first, rank 1 receives first) or 'batched' (one batch_isend_irecv). Returns what was received, or the rules'
    refusal."""
    import torch
    import torch.distributed as dist
    from megatron.guards.nccl_rules import NcclRuleError
    rank = dist.get_rank()
    mine, theirs = torch.full((8,), float(rank)), torch.empty(8)
    try:
        if order == "batched":
            for handle in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                                  dist.P2POp(dist.irecv, theirs, 1 - rank)]):
                handle.wait()
        elif order == "split" or rank == 0:
            dist.send(mine, 1 - rank)
            dist.recv(theirs, 1 - rank)
        else:
            dist.recv(theirs, 1 - rank)
            dist.send(mine, 1 - rank)
    except NcclRuleError as error:
        return str(error)
    return theirs.tolist()


def test_the_rules_refuse_the_split_exchange_on_two_processes():
    results = run_distributed(_exchange, 2, args=("split",), timeout=120)
    for rank, result in enumerate(results):
        assert isinstance(result, str) and "NCCL rule broken: send called from" in result, result
        assert "a point-to-point order NCCL hangs on" in result and f"rank {rank}'s blocking send" in result


@pytest.mark.parametrize("order", ["batched", "even-odd"])
def test_the_batched_and_even_odd_exchanges_pass_the_rules(order):
    assert run_distributed(_exchange, 2, args=(order,), timeout=120) == [[1.0] * 8, [0.0] * 8]
