"""NCCL's point-to-point matching, modelled for the NCCL-rules mode (megatron/guards/nccl_rules.py), so that an
order of sends and receives that hangs on NCCL fails on gloo too, by name.

NCCL matches point-to-point operations per pair of ranks in posting order and ignores tags: rank a's k-th send to
b is b's k-th receive from a, and the two must agree in size and dtype (a tag that differs means the code relies on
gloo's matching by tag). A rank's operations with one peer run in posting order, each starting once the ones before
it finished; operations posted together (one batch_isend_irecv: one NCCL group) progress together, and a blocking
send or receive holds back everything posted after it. So, at a context-parallel ring of 2 (next = previous):

    rank 0: send(1); recv(1)      rank 1: send(0); recv(0)      hangs: each send waits for a receive queued
                                                                behind the other rank's send (gloo hangs on the
                                                                blocking calls too; isend/irecv pass on gloo)
    rank 0: batch_isend_irecv([send(1), recv(1)]), rank 1 the same; or rank 0 sends first, rank 1 receives first: fine

Each process publishes its units (one batch_isend_irecv, one send/recv, one lone isend/irecv) in torch.distributed's
store and replays every unit of the ranks it exchanges with (P2PModel). It raises when two matched operations differ
and when the posted units form a cycle of waits (certain to hang). A blocking send/recv first waits until the model
completes it (as NCCL would); a rank waiting there is published, so a cycle through it is found instead of a hang.
"""
import json
import time

WAIT_SECONDS = 60.0      # a blocking unit the model cannot settle by then runs unchecked (a peer computing long)
# The wait for the peers' units polls the store, backing off: a peer that is computing (most waits, on a loaded
# machine) costs a few polls, not one every 2 ms (each poll is several store round trips on both sides).
POLL_FIRST, POLL_LONGEST = 0.001, 0.032


class P2POrderError(RuntimeError):
    """An order or a pairing of point-to-point operations that NCCL would hang on or mismatch."""


class _Unit:
    def __init__(self, rank, index, ops, blocking):
        self.rank, self.index, self.blocking = rank, index, blocking
        self.ops = [tuple(op) for op in ops]      # (kind "send"|"recv", peer, ordinal, numel, dtype, tag)
        self.pending = set(range(len(self.ops)))
        self.peers = {op[1] for op in self.ops}

    def describe(self, op=None):
        ops = self.ops if op is None else [op]
        text = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} (#{ordinal + 1} that way)"
                         for kind, peer, ordinal, *_ in ops)
        return f"rank {self.rank}'s {'blocking ' if self.blocking else ''}{text}"


class P2PModel:
    """The posted units of some ranks, replayed under NCCL's order (module docstring). add() them in each rank's
    posting order; complete(rank, index) and cycle(blocked) answer after settle()."""

    def __init__(self):
        self.open = {}           # rank -> its units not complete, in posting order
        self.posted = {}         # rank -> units posted so far
        self.where = {}          # (rank, kind, peer, ordinal) -> (unit, op index) of ops not complete

    def add(self, rank, ops, blocking):
        unit = _Unit(rank, self.posted.get(rank, 0), ops, blocking)
        self.posted[rank] = unit.index + 1
        self.open.setdefault(rank, []).append(unit)
        for position, (kind, peer, ordinal, numel, dtype, tag) in enumerate(unit.ops):
            self.where[(rank, kind, peer, ordinal)] = (unit, position)
            match = self.where.get(_match_key(rank, unit.ops[position]))
            if match is not None:
                _check_pair(unit, position, *match)
        return unit

    def started(self, unit):
        """All units it waits for are complete: the earlier ones with a common peer, and any earlier blocking one."""
        for earlier in self.open[unit.rank]:
            if earlier is unit:
                return True
            if earlier.blocking or earlier.peers & unit.peers:
                return False
        return False

    def settle(self):
        """Complete every operation whose unit and whose match's unit have started, until nothing changes."""
        changed = True
        while changed:
            changed = False
            for units in self.open.values():
                for unit in [u for u in units if self.started(u)]:
                    for position in list(unit.pending):
                        match = self.where.get(_match_key(unit.rank, unit.ops[position]))
                        if match is not None and self.started(match[0]):
                            self._finish(unit, position)
                            self._finish(*match)
                            changed = True
            for rank in self.open:
                self.open[rank] = [unit for unit in self.open[rank] if unit.pending]

    def _finish(self, unit, position):
        unit.pending.discard(position)
        kind, peer, ordinal = unit.ops[position][:3]
        self.where.pop((unit.rank, kind, peer, ordinal), None)

    def complete(self, rank, index):
        return index < self.posted.get(rank, 0) and all(unit.index != index for unit in self.open.get(rank, []))

    def cycle(self, blocked=None):
        """A cycle of waits among the open units (each waits for the next to start or complete), as a list of
        (unit, what it waits on), or None. blocked: rank -> the open unit its host waits in (it posts nothing more
        until that completes)."""
        blocked = blocked or {}
        edges = {}
        for units in self.open.values():
            for unit in units:
                edges[unit] = self._waits(unit, blocked)
        for start in edges:
            found = _find_cycle(start, edges)
            if found:
                return found
        return None

    def _waits(self, unit, blocked):
        """[(unit waited on, the wait in words)]: a unit not started waits on the open units before it that hold it
        back; a started one on the units holding its pending ops' matches (or, for a match not posted by a host-
        blocked peer, on the unit the peer is blocked in)."""
        if not self.started(unit):
            before = self.open[unit.rank][:self.open[unit.rank].index(unit)]
            return [(other, f"{unit.describe()} is queued behind") for other in before
                    if other.blocking or other.peers & unit.peers]
        waits = []
        for position in sorted(unit.pending):
            op = unit.ops[position]
            match = self.where.get(_match_key(unit.rank, op))
            if match is not None:
                waits.append((match[0], f"{unit.describe(op)} waits for its match in"))
            elif op[1] in blocked:
                holder = next((u for u in self.open.get(op[1], []) if u.index == blocked[op[1]]), None)
                if holder is not None:
                    waits.append((holder, f"{unit.describe(op)} waits for a match posted only after"))
        return waits


def _match_key(rank, op):
    kind, peer, ordinal = op[:3]
    return (peer, "recv" if kind == "send" else "send", rank, ordinal)


def _check_pair(unit, position, other, other_position):
    mine, theirs = unit.ops[position], other.ops[other_position]
    if mine[3:5] != theirs[3:5] or mine[5] != theirs[5]:
        raise P2POrderError(f"{unit.describe(mine)} pairs (NCCL matches in posting order, per peer, ignoring tags) "
                            f"with {other.describe(theirs)}: {mine[3]} x {mine[4]} tag {mine[5]} against "
                            f"{theirs[3]} x {theirs[4]} tag {theirs[5]}")


def _find_cycle(start, edges):
    """A cycle reachable from `start` (depth-first), as [(unit, why), ...], or None."""
    path, on_path, seen = [], {}, set()

    def visit(unit):
        on_path[unit] = len(path)
        for target, why in edges.get(unit, []):
            path.append((unit, why))
            if target in on_path:
                return path[on_path[target]:]
            if target not in seen:
                found = visit(target)
                if found:
                    return found
            path.pop()
        del on_path[unit]
        seen.add(unit)
        return None
    return visit(start)


def describe_cycle(cycle):
    """The waits of a cycle in words, each naming the unit the next one starts from."""
    targets = [unit for unit, _ in cycle[1:] + cycle[:1]]
    return "; ".join(f"{why} {target.describe()}" for (_, why), target in zip(cycle, targets))


class Tracker:
    """This process's side: publishes its units in the store and replays the ranks it exchanges with."""

    PREFIX = "nccl_rules/p2p"

    def __init__(self, store, rank):
        self.store, self.rank, self.model = store, rank, P2PModel()
        self.read = {}           # rank -> units read from the store
        self.ordinals = {}       # (kind, peer) -> this rank's ops posted that way

    def post(self, ops, blocking):
        """Publish this rank's next unit, ops [(kind, peer, numel, dtype, tag)]; raise P2POrderError when it
        pairs wrongly or completes a cycle (after waiting for the model to complete it, when blocking)."""
        numbered = []
        for kind, peer, numel, dtype, tag in ops:
            ordinal = self.ordinals.get((kind, peer), 0)
            self.ordinals[(kind, peer)] = ordinal + 1
            numbered.append((kind, peer, ordinal, numel, dtype, tag))
        index = self.read.get(self.rank, 0)
        self.store.set(f"{self.PREFIX}/{self.rank}/{index}", json.dumps({"ops": numbered, "blocking": blocking}))
        self.store.add(f"{self.PREFIX}/{self.rank}/n", 1)
        if blocking:
            self.store.set(f"{self.PREFIX}/{self.rank}/blocked", str(index))
        deadline, pause = time.monotonic() + WAIT_SECONDS, POLL_FIRST
        while True:
            blocked = self.refresh()
            if blocking:
                blocked[self.rank] = index
            self.model.settle()
            cycle = self.model.cycle(blocked)
            if cycle:        # (a blocked rank stays marked: the others in the cycle find it too)
                raise P2POrderError(f"a point-to-point order NCCL hangs on: {describe_cycle(cycle)} (post a send "
                                    f"and a receive between the same ranks together, batch_isend_irecv, or in "
                                    f"opposite orders on the two sides)")
            if not blocking or self.model.complete(self.rank, index) or time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_LONGEST)
        if blocking:
            self.store.set(f"{self.PREFIX}/{self.rank}/blocked", "-1")

    def refresh(self):
        """Read the new units of this rank and of every rank reachable through peers; returns {rank: the unit
        its host is blocked in} of the ranks read."""
        todo, done, blocked = [self.rank] + [peer for _, peer in self.ordinals], set(), {}
        while todo:
            rank = todo.pop()
            if rank in done:
                continue
            done.add(rank)
            count = self.store.add(f"{self.PREFIX}/{rank}/n", 0)
            for index in range(self.read.get(rank, 0), count):
                unit = json.loads(self.store.get(f"{self.PREFIX}/{rank}/{index}"))
                self.model.add(rank, unit["ops"], unit["blocking"])
            self.read[rank] = max(self.read.get(rank, 0), count)
            if rank != self.rank and self.store.check([f"{self.PREFIX}/{rank}/blocked"]):
                held = int(self.store.get(f"{self.PREFIX}/{rank}/blocked"))
                if held >= 0:
                    blocked[rank] = held
            todo.extend(peer for unit in self.model.open.get(rank, []) for peer in unit.peers)
        return blocked
