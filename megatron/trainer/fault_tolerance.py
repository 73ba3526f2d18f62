"""Fault-tolerant replica groups on torchft (DESIGN section 21): a failed group costs its share of a step, not a
restart of everyone.

The job is R replica groups, each an ordinary Megatron/ZeRO job with its own torchrun (its own tensor, pipeline and
data parallelism). Across groups, rank r of every group holds the same ZeRO partition, so the reduced gradient
partitions are averaged rank for rank through torchft's Manager over the groups in this step's quorum, and the step
is applied only if torchft's should_commit says so (ZeroOptimizer.replica_sync is the one engine hook); a failed
exchange is redone with a new quorum, so the live groups lose no step. A group that restarts asks the lighthouse
for a quorum and receives the training state (zero.replica_state_dict: weights, optimizer state, loss scaler, lr
scheduler, step counters; the TrainState and RNG states) from a live peer through torchft's checkpoint transport;
no file is read. The lighthouse is torchft's own:

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 1000 --bind 0.0.0.0:29510 &
    # group g = 0 .. R-1, each with its own torchrun (its own --master_port / rendezvous):
    torchrun --nproc_per_node 2 --master_port $((29600 + g)) --max-restarts 3 pretrain_gpt.py ... \\
        --ft-replica-groups 2 --ft-group-id $g --ft-lighthouse http://HOST:29510

Data: group g's data-parallel rank r reads as data-parallel rank g * dp + r of R * dp (sample_shard), so R groups of
dp ranks see exactly the batches of one job at data-parallel size R * dp; --ft-replay-dropped trains on a dropped
group's share at a later step (ReplicaTraining). One group (R = 1, no flag) imports no torchft and adds no
collective. docs/operations.md says when to use it.
"""
import dataclasses
import time
from datetime import timedelta

import torch

from megatron.cli import UserError


EXCHANGE_RETRIES = 2   # new quorums a group asks for after a failed gradient exchange before it discards the step


class FaultToleranceError(UserError):
    """Replica-group settings that cannot work (a group id out of range, no lighthouse, torchft missing)."""


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """The replica-group settings (--ft-* flags, or the JSON's "fault_tolerance" block: the JSON wins)."""
    groups: int = 1
    """R, the number of replica groups (1: no fault tolerance, torchft is not imported)."""
    group_id: int = 0
    """This job's group, 0 .. R-1: its share of each global batch and its torchft replica id."""
    lighthouse: str = ""
    """The lighthouse's address (http://HOST:PORT); empty: the TORCHFT_LIGHTHOUSE environment variable."""
    min_replicas: int = 1
    """A step commits only with at least this many groups in the quorum."""
    timeout_s: float = 60.0
    """torchft's timeout for the gradient exchange, should_commit, quorum and the checkpoint transfer (seconds)."""
    replay_dropped: bool = False
    """Queue the samples of a group that was out of a step and train on them at the next steps (ReplicaTraining)."""

    @classmethod
    def from_args(cls, args):
        return cls(groups=args.ft_replica_groups, group_id=args.ft_group_id, lighthouse=args.ft_lighthouse or "",
                   min_replicas=args.ft_min_replicas, timeout_s=args.ft_timeout,
                   replay_dropped=args.ft_replay_dropped)

    def check(self):
        """One line naming the bad value, before anything is built."""
        if self.groups < 1:
            raise FaultToleranceError(f"--ft-replica-groups ({self.groups}) must be at least 1")
        if not 0 <= self.group_id < self.groups:
            raise FaultToleranceError(f"--ft-group-id ({self.group_id}) must be in [0, {self.groups}) for "
                                      f"--ft-replica-groups {self.groups}")
        if not 1 <= self.min_replicas <= self.groups:
            raise FaultToleranceError(f"--ft-min-replicas ({self.min_replicas}) must be in [1, {self.groups}]")
        if not self.timeout_s > 0:
            raise FaultToleranceError(f"--ft-timeout ({self.timeout_s}) must be positive")
        if self.replay_dropped and self.groups == 1:
            raise FaultToleranceError("--ft-replay-dropped needs --ft-replica-groups 2 or more (one group drops no "
                                      "samples): drop the flag")


def sample_shard(groups, group_id, data_parallel_rank, data_parallel_size):
    """(rank, size) the sampler reads as: group g's rank r is rank g * dp + r of R * dp. With R = 2, dp = 2:
    group 0 reads as ranks 0, 1 and group 1 as ranks 2, 3 of one data-parallel-4 job."""
    return group_id * data_parallel_size + data_parallel_rank, groups * data_parallel_size


def group_sample_indices(consumed, groups, group_id, data_parallel_size, micro_batch_size, micro_batches):
    """Global sample indices group `group_id` trains on in the step that starts after `consumed` samples
    (megatron.data.samplers' order: micro batch k of the step spans R * dp * micro samples)."""
    stride = groups * data_parallel_size * micro_batch_size
    first = group_id * data_parallel_size * micro_batch_size
    return [consumed + k * stride + first + i for k in range(micro_batches)
            for i in range(data_parallel_size * micro_batch_size)]


def _forget_previous_manager(group_rank, group_world_size, store_addr, store_port):
    """torchft's Manager publishes group rank 0's server address in the group's store, and the other ranks read it;
    after a torchrun restart (one store for every attempt) or a second Manager in one process they could read the
    dead one's. Rank 0 deletes the keys before anyone builds a Manager; the others then wait for the new ones."""
    if group_world_size == 1:
        return
    import os
    import torch.distributed as dist
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY
    if group_rank == 0:
        store = dist.TCPStore(store_addr or os.environ["MASTER_ADDR"], int(store_port or os.environ["MASTER_PORT"]),
                              is_master=False, wait_for_workers=False)
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


def _on_every_rank(flag, device):
    """Whether `flag` (a bool, or a one-element tensor on `device`: no host sync before the all-reduce) holds on
    every rank of this group (one MIN all-reduce in the group, one host sync): the group decides as one (its ranks'
    quorum requests and should_commit are group-wide in torchft)."""
    import torch.distributed as dist
    value = (flag.float().reshape(1) if torch.is_tensor(flag) else torch.tensor([float(flag)], device=device))
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _restartable(train_iterator, what):
    if not hasattr(train_iterator, "restart_at"):
        raise FaultToleranceError(f"{what} this training data source: use an indexed dataset (--data-path PREFIX) "
                                  "or --mock-data")


def _cross_group_process_group(torchft, timeout):
    """torchft's process group over the replica groups, on the backend mpu chose for this rank's device (NCCL with
    the accelerator's tensors on CUDA, gloo on the CPU): the exchanged partitions stay on the device."""
    import mpu
    if mpu.get_backend() == "nccl":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    return torchft.ProcessGroupGloo(timeout=timeout)


class ReplicaGroup:
    """This rank's side of its group in the torchft quorum: start_step() before the forward (quorum; a heal is
    applied there), average_and_commit(partition_grads) as the optimizer's replica_sync. `state_dict` and
    `load_state_dict` are the training state handed to / taken from a healing peer. `store_addr/port`: the group's
    TCPStore (default: MASTER_ADDR/MASTER_PORT, torchrun's)."""

    def __init__(self, settings, state_dict, load_state_dict, group_rank, group_world_size, store_addr=None,
                 store_port=None, nonfinite_is_fault=True):
        try:
            import torchft   # optional: imported only with 2+ groups
        except ImportError as error:
            raise FaultToleranceError(f"--ft-replica-groups {settings.groups} needs torchft ({error}): "
                                      "pip install torchft") from None
        import os
        lighthouse = settings.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise FaultToleranceError("no lighthouse: pass --ft-lighthouse http://HOST:PORT (or set "
                                      "TORCHFT_LIGHTHOUSE), after starting torchft_lighthouse")
        self.settings, self.nonfinite_is_fault = settings, nonfinite_is_fault
        self.state_dict, self._load = state_dict, load_state_dict
        self.heals = []        # (torchft step, seconds from asking for the quorum to the state loaded) of each heal
        self.quorums = []      # per step: the group ids whose gradients were averaged
        self.committed = []    # per step: should_commit's answer
        timeout = timedelta(seconds=settings.timeout_s)
        _forget_previous_manager(group_rank, group_world_size, store_addr, store_port)
        self.manager = torchft.Manager(
            pg=_cross_group_process_group(torchft, timeout), load_state_dict=self._heal, state_dict=state_dict,
            min_replica_size=settings.min_replicas, use_async_quorum=False, init_sync=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout, rank=group_rank, world_size=group_world_size,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse,
            replica_id=f"group{settings.group_id}")
        self.exchange_attempts = []   # per step: how many exchanges it took (1: no failure)
        self._retrying = False
        self._stashed = None   # a peer's state received while retrying an exchange: loaded before the next step

    def _heal(self, state):
        if self._retrying:   # mid-step: this step's gradients are stale; the state is loaded before the next one
            self._stashed = (state, self.manager.current_step(), time.monotonic())
            return
        self._load(state)
        self.heals.append((self.manager.current_step(), None))

    def start_step(self):
        """Join this step's quorum (blocking); a group behind the others receives their state here (through
        torchft's checkpoint transport) and loads it (or loads the one it received while retrying its last
        exchange). Returns whether it healed."""
        heals, started = len(self.heals), time.monotonic()
        if self._stashed is not None:
            (state, step, started), self._stashed = self._stashed, None
            self._load(state)
            self.heals.append((step, None))
        self.manager.start_quorum()
        if len(self.heals) == heals:
            return False
        self.heals[-1] = (self.heals[-1][0], time.monotonic() - started)
        return True

    def average_and_commit(self, partition_grads):
        """Average each reduced partition over the groups that contributed to it (in place) and say whether to
        apply the step. A failed exchange (a peer died or stalled past the timeout) does not cost the step: the
        group's own partitions (kept aside: one copy of them) are put back, a new quorum is asked for (the
        lighthouse drops a dead peer once its heartbeat stops) and the exchange is redone with the groups in it,
        EXCHANGE_RETRIES times at most, then the step is discarded. A group whose gradients hold a NaN/inf (the
        check is group-wide; not under fp16, whose loss scaler skips such steps everywhere), or whose state was
        replaced by a peer's while retrying, contributes nothing and reports an error to torchft: its
        should_commit is False, it heals at its next step, and the others' step is theirs alone."""
        device = partition_grads[0].device
        own = [grad.clone() for grad in partition_grads]   # the exchange is in place; a failed one leaves garbage
        contribute = not self.nonfinite_is_fault or _on_every_rank(     # all partitions checked on the device
            torch.stack([torch.isfinite(grad).all() for grad in partition_grads]).all(), device)
        members, attempts = self._exchange(partition_grads, contribute), 1
        while not _on_every_rank(self.manager.errored() is None, device) and attempts <= EXCHANGE_RETRIES:
            for grad, mine in zip(partition_grads, own):
                grad.copy_(mine)
            self._retrying = True
            try:
                self.manager.start_quorum()
            finally:
                self._retrying = False
            contribute = contribute and self._stashed is None
            members, attempts = self._exchange(partition_grads, contribute), attempts + 1
        if not contribute:
            self.manager.report_error(RuntimeError(f"group {self.settings.group_id}'s gradients are not usable "
                                                   "this step (a NaN/inf, or a heal mid-step)"))
        committed = self.manager.should_commit()
        quorum = [g for g, member in enumerate(members.tolist()) if member > 0.5]   # one host read
        if committed:
            for grad in partition_grads:
                grad.div_(len(quorum))
        self.quorums.append(quorum)
        self.committed.append(committed)
        self.exchange_attempts.append(attempts)
        return committed

    def _exchange(self, partition_grads, contribute):
        """Sum the partitions and a one-hot of this group over the quorum; a group that does not contribute sends
        zeros. Returns the summed one-hots (which groups' gradients are in the sums)."""
        from torch.distributed import ReduceOp
        member = torch.zeros(self.settings.groups, dtype=torch.float32, device=partition_grads[0].device)
        if contribute:
            member[self.settings.group_id] = 1.0
        else:
            for grad in partition_grads:
                grad.zero_()
        works = [self.manager.allreduce(grad, reduce_op=ReduceOp.SUM) for grad in partition_grads]
        works.append(self.manager.allreduce(member, reduce_op=ReduceOp.SUM))
        for work in works:
            work.wait()
        return member

    def shutdown(self):
        self.manager.shutdown(wait=True)   # wait=False leaves a thread that aborts the process at exit


class NoReplicaGroups:
    """One group (R = 1): the training loop's calls do nothing, and torchft is never imported."""

    def before_step(self, train_iterator):
        return train_iterator

    def after_step(self, iteration, history):
        pass

    def shutdown(self):
        pass


class ReplicaTraining:
    """megatron/training.py's side: before_step() joins the quorum (and after a heal restarts the data at the
    peer's position), after_step() logs the quorum, the dropped samples (by global sample index) and heals.

    A step's global batch is R shares, group g training on share g. With --ft-replay-dropped the shares of the groups
    out of a step go to `replay_queue` (part of the state a healing peer receives), and the next steps take up to R
    queued shares first (each group reading its share by sample index), then fresh ones from the consumed position,
    which advances by the fresh shares only: every sample is trained on once."""

    def __init__(self, replica, args, train_state, replay_queue):
        self.replica, self.args, self.train_state = replica, args, train_state
        self.replay_queue = replay_queue
        self._consumed = None      # where the step being taken starts in the global sample order
        self._shares, self._replayed = None, 0   # the step's shares (group g's at g), how many came from the queue

    @classmethod
    def from_args(cls, args, engine, train_state):
        """NoReplicaGroups at R = 1; otherwise this rank's ReplicaGroup, hooked into the engine's optimizer."""
        settings = ReplicaSettings.from_args(args)
        if settings.groups == 1:
            return NoReplicaGroups()
        import torch.distributed as dist
        from megatron import zero
        from megatron.checkpoint.rng import get_rng_state, set_rng_state
        replay_queue = []

        def state_dict():
            return {"engine": zero.replica_state_dict(engine), "train_state": train_state.to_state(),
                    "rng": get_rng_state(), "replay_queue": [list(share) for share in replay_queue]}

        def load_state_dict(state):
            zero.load_replica_state_dict(engine, state["engine"])
            for name in train_state.COUNTERS:
                setattr(train_state, name, int(state["train_state"][name]))
            set_rng_state(state["rng"])
            replay_queue[:] = state["replay_queue"]
        replica = ReplicaGroup(settings, state_dict, load_state_dict, dist.get_rank(), dist.get_world_size(),
                               nonfinite_is_fault=not args.fp16)
        engine.optimizer.replica_sync = replica.average_and_commit
        return cls(replica, args, train_state, replay_queue)

    def before_step(self, train_iterator):
        if self.replica.start_step():
            step, seconds = self.replica.heals[-1]
            self._print(f"healed from a live group at iteration {self.train_state.iteration} (torchft step {step}) "
                        f"in {seconds:.2f} s")
            self._log({"event": "heal", "iteration": self.train_state.iteration, "torchft_step": step,
                       "heal_seconds": seconds})
            if train_iterator is not None:
                _restartable(train_iterator, "a healed group cannot move")
                train_iterator.restart_at(self.train_state.consumed_train_samples)
        self._consumed = self.train_state.consumed_train_samples
        self._plan()
        if self._replayed and train_iterator is not None:
            _restartable(train_iterator, "--ft-replay-dropped cannot re-read samples of")
            fresh = (len(self._shares) - self._replayed) * self.args.global_batch_size
            train_iterator.play(self._micro_batches(self._shares[self.replica.settings.group_id]),
                                self._consumed + fresh)
        return train_iterator

    def _micro_batches(self, share):
        """This rank's micro batches of a group's share (group_sample_indices' layout: micro batch k of the share
        spans dp x micro samples, data-parallel rank r's are the r-th micro of them)."""
        import mpu
        micro, dp, rank = self.args.batch_size, self.args.data_parallel_size, mpu.get_data_parallel_rank()
        return [share[k * dp * micro + rank * micro:][:micro] for k in range(len(share) // (dp * micro))]

    def _plan(self):
        """This step's shares: up to R from the replay queue, the rest fresh from the consumed position (laid out
        as a job of that many groups would read them; with none queued, exactly the samplers' order)."""
        settings, args = self.replica.settings, self.args
        self._replayed = min(len(self.replay_queue), settings.groups) if settings.replay_dropped else 0
        fresh = settings.groups - self._replayed
        self._shares = self.replay_queue[:self._replayed] + [
            group_sample_indices(self._consumed, fresh, j, args.data_parallel_size, args.batch_size,
                                 args.num_micro_batches) for j in range(fresh)]

    def after_step(self, iteration, history):
        """Log this step's quorum; the samples of the groups whose gradients were not applied are dropped."""
        settings, quorum = self.replica.settings, self.replica.quorums[-1]
        committed = self.replica.committed[-1]
        history.setdefault("ft quorum", []).append(len(quorum) if committed else 0)
        history.setdefault("ft heals", [])[:] = self.replica.heals
        lost = [g for g in range(settings.groups) if g not in quorum or not committed]
        dropped = {g: self._shares[g] for g in lost}
        self.train_state.consumed_train_samples -= self._replayed * self.args.global_batch_size   # not fresh ones
        if settings.replay_dropped:
            self.replay_queue[:] = self.replay_queue[self._replayed:] + [self._shares[g] for g in lost]
        attempts = self.replica.exchange_attempts[-1]
        self._log({"event": "step", "iteration": iteration, "quorum": len(quorum) if committed else 0,
                   "committed": committed, "exchanges": attempts, "replayed": self._shares[:self._replayed],
                   "dropped": {str(g): indices for g, indices in dropped.items()}})
        if attempts > 1:
            self._print(f"iteration {iteration}: the gradient exchange failed; redone {attempts - 1} time(s) with a "
                        f"new quorum")
        if not lost:
            return
        history.setdefault("ft dropped", {}).update({(iteration, g): indices for g, indices in dropped.items()})
        for g, indices in dropped.items():
            self._print(f"iteration {iteration}: quorum {quorum} of {settings.groups} groups, "
                        f"{'committed' if committed else 'discarded'}; dropped group {g}'s samples {indices}")

    def _log(self, fields):
        """A --log-jsonl record of this group (rank 0): every step's quorum size and a heal's duration (plotted by
        tools/plot_run.py)."""
        import torch.distributed as dist
        if self.args.log_jsonl and dist.get_rank() == 0:
            from megatron.guards import operations
            operations.write_jsonl_record(self.args.log_jsonl, {"type": "ft", "group": self.replica.settings.group_id,
                                                                "groups": self.replica.settings.groups, **fields})

    def _print(self, text):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            print(f" > ft group {self.replica.settings.group_id}: {text}", flush=True)

    def shutdown(self):
        self.replica.shutdown()
