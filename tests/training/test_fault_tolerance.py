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

pytest.importorskip("torchft")

STAGES = (1, 2, 3)
STEPS, MICRO, ACCUMULATION, GROUPS, GROUP_DP = 4, 2, 2, 2, 2
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
    """This rank's ReplicaGroup, hooked into the engine. Rank 0 first: it publishes the group's manager address
    in the group's store, which a second Manager in the same launch overwrites."""
    import torch.distributed as dist
    from megatron import zero
    from megatron.trainer.fault_tolerance import ReplicaGroup, ReplicaSettings
    settings = ReplicaSettings(groups=GROUPS, group_id=group_id, lighthouse=lighthouse, min_replicas=1,
                               timeout_s=30)
    replica = None
    for turn in range(2):
        if (dist.get_rank() == 0) == (turn == 0):
            replica = ReplicaGroup(settings, lambda: zero.replica_state_dict(engine),
                                   lambda state: zero.load_replica_state_dict(engine, state),
                                   dist.get_rank(), dist.get_world_size())
        dist.barrier()
    engine.optimizer.replica_sync = replica.average_and_commit
    return replica


def _train_group(group_id, lighthouses):
    out = {}
    for stage, lighthouse in zip(STAGES, lighthouses):
        engine = _engine(stage)
        replica = _replica_group(engine, group_id, lighthouse)
        losses = []
        for step in range(STEPS):
            replica.start_step()
            losses.append(_group_step(engine, step, group_id))
        out[stage] = {"losses": losses, "quorums": replica.quorums, "committed": replica.committed,
                      "weights": _full_weights(engine)}
        replica.shutdown()
    return out


def _train_dp4():
    out = {}
    for stage in STAGES:
        engine = _engine(stage)
        losses = [engine_train_step(engine, step, GLOBAL) for step in range(STEPS)]
        out[stage] = {"losses": losses, "weights": _full_weights(engine)}
    return out


@pytest.fixture(scope="module")
def no_fault_runs():
    """Both groups (one lighthouse per stage, needing both groups for a quorum: no group starts alone) and the
    data-parallel-4 reference."""
    from torchft._torchft import LighthouseServer
    lighthouses = [LighthouseServer(bind="127.0.0.1:0", min_replicas=GROUPS, join_timeout_ms=10000,
                                    quorum_tick_ms=20) for _ in STAGES]
    addresses = [server.address() for server in lighthouses]
    try:
        with ThreadPoolExecutor(GROUPS) as pool:
            launches = [pool.submit(run_distributed, _train_group, GROUP_DP, args=(g, addresses))
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
    for group in groups:
        for rank in range(GROUP_DP):
            for mine, theirs in zip(group[rank][stage]["weights"], reference[stage]["weights"]):
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


def test_one_group_imports_no_torchft(tmp_path):
    """R = 1 (no flag): pretrain_gpt trains without importing torchft and without the replica hook."""
    import subprocess
    from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE
    argv = MOCK_VOCAB + TINY_SHAPE + ["--train-iters", "2", "--eval-iters", "0", "--ft-replica-groups", "1"]
    code = ("import sys, pretrain_gpt\n"
            f"pretrain_gpt.main({argv!r})\n"
            "assert 'torchft' not in sys.modules, 'torchft imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
