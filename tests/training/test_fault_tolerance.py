"""Fault-tolerant replica groups on torchft (issue 72): two replica groups of two gloo ranks each, each its own
launch (its own process group and store, as its own torchrun would give it), meeting through torchft's Manager and
a lighthouse on loopback; against one data-parallel-4 job of the same global batch."""
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.data.samplers import MegatronPretrainingSampler
from megatron.spawn import run_distributed
from tests.helpers import batch, ds_config, engine_train_step, param_groups, TinyNet

STAGES = (1, 2, 3)
STEPS, MICRO, ACCUMULATION, GROUPS, GROUP_DP = 4, 2, 2, 2, 2
HEAL_AT, TOGETHER = 2, 2   # heal runs: group 0 trains steps 0, 1 (or more) alone; group 1 joins, 2 steps together
GLOBAL = MICRO * ACCUMULATION * GROUPS * GROUP_DP      # 16 samples per step, as a dp-4 job's
CLIP = 0.05      # below the gradient norm: the clip coefficient needs the norm of the groups' averaged gradients


def _engine(stage):
    from megatron import zero
    model = TinyNet()
    config = {**ds_config(stage, MICRO, ACCUMULATION, reduce_bucket_size=100,
                          stage3_param_persistence_threshold=40), "gradient_clipping": CLIP}
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
                                      config=config, dist_init_required=False)
    return engine


def _full_weights(engine):
    from megatron import zero
    params = list(engine.module.parameters())
    with zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def _group_step(engine, step, group_id):
    """One step on this group's share of the global batch of `step` (the sampler's shard); the group's loss."""
    import torch.distributed as dist
    from megatron.trainer.fault_tolerance import sample_shard
    ctx = engine.ctx
    rank, _ = sample_shard(GROUPS, group_id, ctx.data_parallel_rank, ctx.data_parallel_size)
    x, y = batch(step, GLOBAL)
    total = torch.zeros(1, dtype=torch.float64)
    for k in range(ACCUMULATION):
        lo = (rank * ACCUMULATION + k) * MICRO
        loss = engine(x[lo:lo + MICRO], y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        total += loss.item()
    dist.all_reduce(total, group=ctx.data_parallel_group)
    return float(total) / (ctx.data_parallel_size * ACCUMULATION)


def _replica_group(engine, group_id, lighthouse):
    """This rank's ReplicaGroup, hooked into the engine, on a store of its own: torchft keys its process groups'
    rendezvous by quorum id in the group's store, and every phase's lighthouse counts quorum ids from 1 again."""
    import torch.distributed as dist
    from megatron import zero
    from megatron.trainer.fault_tolerance import ReplicaGroup, ReplicaSettings
    port, store = torch.zeros(1, dtype=torch.int64), None
    if dist.get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, 0)
    settings = ReplicaSettings(groups=GROUPS, group_id=group_id, lighthouse=lighthouse, min_replicas=1,
                               timeout_s=120)
    replica = ReplicaGroup(settings, lambda: zero.replica_state_dict(engine),
                           lambda state: zero.load_replica_state_dict(engine, state), dist.get_rank(),
                           dist.get_world_size(), store_addr="127.0.0.1", store_port=int(port))
    replica.store = store      # held for the phase
    engine.optimizer.replica_sync = replica.average_and_commit
    return replica


def _wait_for(path):
    import os
    import time
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def _train(engine, replica, group_id, before_step=lambda step: None, done=None):
    """Steps from where the engine is (a healed group: from the peer's step) until `done()` (default: STEPS
    steps); {step: loss} and {step: the training state right after the step's quorum (a heal is applied there),
    and the gradient norm}."""
    from megatron import zero
    losses, states = {}, {}
    done = done or (lambda: engine.global_steps >= STEPS)
    while not done():
        before_step(engine.global_steps)
        replica.start_step()
        step = engine.global_steps
        states[step] = zero.replica_state_dict(engine)
        losses[step] = _group_step(engine, step, group_id)
        states[step]["grad_norm"] = engine.get_global_grad_norm()
    return losses, states


def _heal_phase(group_id, stage, lighthouse, markers):
    """Group 0 trains HEAL_AT steps alone; then group 1 starts (a fresh engine) and heals from it."""
    import os
    import torch.distributed as dist
    engine = _engine(stage)
    joined = os.path.join(markers, f"joined{stage}")
    if group_id == 1:
        _wait_for(os.path.join(markers, f"alone{stage}"))
    replica = _replica_group(engine, group_id, lighthouse)
    if group_id == 1 and dist.get_rank() == 0:
        open(joined, "w").close()

    def wait_for_group_1(step):     # every rank: a rank waiting in the quorum alone would time out
        if step == HEAL_AT:
            if dist.get_rank() == 0:
                open(os.path.join(markers, f"alone{stage}"), "w").close()
            _wait_for(joined)
    # group 0 trains alone until group 1's quorum request is in (at HEAL_AT or a step or two later on a loaded
    # machine), then both train TOGETHER steps
    losses, states = _train(engine, replica, group_id, wait_for_group_1 if group_id == 0 else lambda step: None,
                            done=lambda: replica.quorums.count([0, 1]) >= TOGETHER)
    result = {"losses": losses, "states": states, "heals": replica.heals, "quorums": replica.quorums,
              "weights": _full_weights(engine)}
    replica.shutdown()
    return result


NAN_AT = 1   # the NaN phase: one NaN in group 1's rank-0 partition at this step (ZeRO-2)


def _nan_phase(group_id, lighthouse):
    """Both groups train STEPS steps; at NAN_AT group 1's rank 0 alone holds a NaN gradient."""
    import torch.distributed as dist
    engine = _engine(2)
    replica = _replica_group(engine, group_id, lighthouse)

    def sync(partition_grads):
        if group_id == 1 and dist.get_rank() == 0 and engine.global_steps == NAN_AT:
            partition_grads[0].view(-1)[0] = float("nan")
        return replica.average_and_commit(partition_grads)
    engine.optimizer.replica_sync = sync
    losses, _ = _train(engine, replica, group_id)
    result = {"losses": losses, "quorums": replica.quorums, "committed": replica.committed, "heals": replica.heals,
              "weights": _full_weights(engine)}
    replica.shutdown()
    return result


def _train_group(group_id, lighthouses, heal_lighthouses, markers, nan_lighthouse):
    out = {}
    for stage, lighthouse in zip(STAGES, lighthouses):
        engine = _engine(stage)
        replica = _replica_group(engine, group_id, lighthouse)
        losses, states = _train(engine, replica, group_id)
        out[stage] = {"losses": [losses[step] for step in range(STEPS)], "quorums": replica.quorums,
                      "grad_norms": [states[step]["grad_norm"] for step in range(STEPS)],
                      "committed": replica.committed, "weights": _full_weights(engine)}
        replica.shutdown()
    for stage, lighthouse in zip(STAGES, heal_lighthouses):
        out[("heal", stage)] = _heal_phase(group_id, stage, lighthouse, markers)
    out["nan"] = _nan_phase(group_id, nan_lighthouse)
    return out


def _train_dp4():
    out = {}
    for stage in STAGES:
        engine = _engine(stage)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(engine_train_step(engine, step, GLOBAL))
            norms.append(engine.get_global_grad_norm())
        out[stage] = {"losses": losses, "grad_norms": norms, "weights": _full_weights(engine)}
    return out


@pytest.fixture(scope="module")
def no_fault_runs(tmp_path_factory):
    """Both groups (one lighthouse per stage needing both groups for a quorum, so no group starts alone; then one
    per stage for the heal runs, where one group is enough) and the data-parallel-4 reference."""
    from torchft._torchft import LighthouseServer
    lighthouses = [LighthouseServer(bind="127.0.0.1:0", min_replicas=minimum, join_timeout_ms=20000,
                                    quorum_tick_ms=20) for minimum in (GROUPS, 1) for _ in STAGES]
    lighthouses.append(LighthouseServer(bind="127.0.0.1:0", min_replicas=GROUPS, join_timeout_ms=20000,
                                        quorum_tick_ms=20))     # the NaN phase
    addresses = [server.address() for server in lighthouses]
    markers = str(tmp_path_factory.mktemp("ft_markers"))
    try:
        with ThreadPoolExecutor(GROUPS) as pool:
            launches = [pool.submit(run_distributed, _train_group, GROUP_DP,
                                    args=(g, addresses[:len(STAGES)], addresses[len(STAGES):-1], markers,
                                          addresses[-1]))
                        for g in range(GROUPS)]
            groups = [launch.result() for launch in launches]
    finally:
        for server in lighthouses:
            server.shutdown()
    return groups, run_distributed(_train_dp4, GROUPS * GROUP_DP)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_two_groups_equal_one_data_parallel_4_job(no_fault_runs, stage):
    groups, reference = no_fault_runs
    for group in groups:
        assert group[0][stage]["quorums"] == [[0, 1]] * STEPS
        assert group[0][stage]["committed"] == [True] * STEPS
    # each group's loss is the mean over its half of the global batch: the two halves' mean is the dp-4 loss
    losses = [(a + b) / 2 for a, b in zip(groups[0][0][stage]["losses"], groups[1][0][stage]["losses"])]
    assert losses == pytest.approx(reference[stage]["losses"], rel=1e-6, abs=0)
    for group in groups:      # the norm of the averaged gradients (Adam and clipping hide a wrong scale)
        assert group[0][stage]["grad_norms"] == pytest.approx(reference[stage]["grad_norms"], rel=1e-6, abs=0)
    for group in groups:
        for rank in range(GROUP_DP):
            for mine, theirs in zip(group[rank][stage]["weights"], reference[stage]["weights"]):
                assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def _reference_replaying(quorums):
    """Plain torch AdamW on one process; step i trains on the samples of the groups in quorums[i] (group 0's: the
    first GLOBAL / 2 of the step's batch, group 1's the rest). The losses and final weights."""
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    losses, half = [], GLOBAL // GROUPS
    for step, quorum in enumerate(quorums):
        x, y = batch(step, GLOBAL)
        rows = torch.cat([torch.arange(g * half, (g + 1) * half) for g in quorum])
        loss = model(x[rows], y[rows])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", STAGES)
def test_a_late_group_heals_from_the_live_one_rank_for_rank(no_fault_runs, stage):
    """Group 1 starts after group 0 has trained HEAL_AT steps alone: it receives weights, optimizer state, loss
    scaler, scheduler and counters from group 0, rank for rank (dp 2: each rank its own partition), through
    torchft's checkpoint transport; right after the heal its state is group 0's bitwise, and the trajectory is that
    of a reference replaying group 0's logged quorum."""
    from tests.helpers import assert_bitwise
    groups, _ = no_fault_runs
    for rank in range(GROUP_DP):
        survivor, healed = groups[0][rank][("heal", stage)], groups[1][rank][("heal", stage)]
        assert survivor["heals"] == [] and len(healed["heals"]) == 1
        heal_step = healed["heals"][0][0]
        assert heal_step >= HEAL_AT and sorted(healed["losses"]) == list(range(heal_step, heal_step + TOGETHER))
        assert survivor["quorums"] == [[0]] * heal_step + [[0, 1]] * TOGETHER
        assert_bitwise(survivor["states"][heal_step], healed["states"][heal_step])
        for mine, theirs in zip(survivor["weights"], healed["weights"]):
            assert torch.equal(mine, theirs)
    reference_losses, reference_weights = _reference_replaying(survivor["quorums"])
    losses = [survivor["losses"][step] if step < heal_step else
              (survivor["losses"][step] + healed["losses"][step]) / 2 for step in range(heal_step + TOGETHER)]
    assert losses == pytest.approx(reference_losses, rel=1e-6, abs=0)
    for mine, theirs in zip(survivor["weights"], reference_weights):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def test_a_nan_on_one_rank_keeps_its_whole_group_out_of_that_step(no_fault_runs):
    """Group 1's rank 0 alone holds a NaN at step NAN_AT: both of its ranks contribute nothing (the group decides as
    one: rank 1 of group 0 must not average rank 1 of group 1's partition in), group 1 does not commit and heals at
    the next step, and group 0's step is its own: the trajectory of a reference without group 1 at that step."""
    groups, _ = no_fault_runs
    for rank in range(GROUP_DP):
        survivor, faulty = groups[0][rank]["nan"], groups[1][rank]["nan"]
        quorums = [[0, 1]] * NAN_AT + [[0]] + [[0, 1]] * (STEPS - NAN_AT - 1)
        assert survivor["quorums"] == quorums and all(survivor["committed"]) and survivor["heals"] == []
        assert faulty["quorums"][NAN_AT] == [0] and faulty["committed"][NAN_AT] is False
        assert len(faulty["heals"]) == 1
        for mine, theirs in zip(survivor["weights"], faulty["weights"]):
            assert torch.equal(mine, theirs)
    reference_losses, reference_weights = _reference_replaying(quorums)
    losses = [survivor["losses"][step] if step == NAN_AT else (survivor["losses"][step] + faulty["losses"][step]) / 2
              for step in range(STEPS)]
    assert losses == pytest.approx(reference_losses, rel=1e-6, abs=0)
    for mine, theirs in zip(survivor["weights"], reference_weights):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def test_group_shards_tile_the_data_parallel_order():
    """R = 2 groups of dp 2 read exactly what ranks 0..3 of one dp-4 sampler read; R = 3 groups of dp 1 too."""
    from megatron.trainer.fault_tolerance import group_sample_indices, sample_shard
    for groups, dp in ((2, 2), (3, 1)):
        for g in range(groups):
            for r in range(dp):
                rank, size = sample_shard(groups, g, r, dp)
                mine = MegatronPretrainingSampler(100, 6, 2, rank, size)
                reference = MegatronPretrainingSampler(100, 6, 2, g * dp + r, groups * dp)
                assert list(mine) == list(reference)
            # the group's samples of the step after 6 consumed, 2 micro batches: its ranks' first two batches
            shard = [i for r in range(dp) for b in list(MegatronPretrainingSampler(
                100, 6, 2, *sample_shard(groups, g, r, dp)))[:2] for i in b]
            assert sorted(group_sample_indices(6, groups, g, dp, 2, 2)) == sorted(shard)


def _train_one_group(argv):
    """pretrain_gpt on one process at R = 1; whether torchft was imported, whether the hook was set."""
    from tests.helpers import train_keeping_model
    import megatron.training as training
    engines = []
    original = training.ReplicaTraining.from_args
    training.ReplicaTraining.from_args = lambda args, engine, state: engines.append(engine) or original(
        args, engine, state)
    train_keeping_model(argv)
    return "torchft" in sys.modules, engines[0].optimizer.replica_sync


def test_one_group_imports_no_torchft(tmp_path):
    """R = 1 (the flag's default, given here): pretrain_gpt trains without importing torchft and without the
    replica hook (no extra collective)."""
    from tests.helpers import MOCK_VOCAB, TINY_SHAPE, write_config
    argv = MOCK_VOCAB + TINY_SHAPE + ["--train-iters", "2", "--eval-iters", "0", "--ft-replica-groups", "1",
                                      "--deepspeed", "--deepspeed_config", write_config(str(tmp_path))]
    imported, hook = run_distributed(_train_one_group, 1, args=(argv,))[0]
    assert not imported and hook is None


def test_the_json_block_sets_the_flags_and_bad_settings_are_one_line(tmp_path, capsys):
    """The JSON's fault_tolerance block sets --ft-replica-groups, --ft-timeout and --ft-replay-dropped (a key it leaves
    out leaves its flag alone); a disagreeing flag, R > 1 without --deepspeed, a group id outside [0, R),
    --ft-replay-dropped with one group and a non-bool replay_dropped are one line each."""
    from megatron.arguments import parse_args
    from tests.helpers import MOCK_VOCAB, parser_error, write_config
    block = {"fault_tolerance": {"replica_groups": 3, "timeout": 7, "replay_dropped": True}}
    config = write_config(str(tmp_path), **block)
    deepspeed = ["--mock-data", "--deepspeed", "--deepspeed_config", config]
    args = parse_args(args_list=deepspeed + ["--ft-group-id", "2", "--ft-min-replicas", "2"])
    assert (args.ft_replica_groups, args.ft_timeout, args.ft_min_replicas, args.ft_group_id) == (3, 7, 2, 2)
    assert args.ft_replay_dropped
    parse = lambda argv: parse_args(args_list=argv)   # noqa: E731
    line = parser_error(parse, deepspeed + ["--ft-replica-groups", "2"], capsys)
    assert "--ft-replica-groups (2) disagrees with fault_tolerance.replica_groups (3)" in line
    line = parser_error(parse, deepspeed + ["--ft-group-id", "3"], capsys)
    assert "--ft-group-id (3) must be in [0, 3)" in line
    line = parser_error(parse, MOCK_VOCAB + ["--ft-replica-groups", "2"], capsys)
    assert "--ft-replica-groups 2 needs --deepspeed" in line
    line = parser_error(parse, MOCK_VOCAB + ["--ft-replay-dropped"], capsys)
    assert "--ft-replay-dropped needs --ft-replica-groups 2 or more" in line
    (tmp_path / "bad").mkdir()
    bad = write_config(str(tmp_path / "bad"), fault_tolerance={"replica_groups": 2, "replay_dropped": "yes"})
    line = parser_error(parse, ["--mock-data", "--deepspeed", "--deepspeed_config", bad], capsys)
    assert "fault_tolerance.replay_dropped: expected bool, got str 'yes'" in line
