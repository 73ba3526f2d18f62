"""ZeRO-3 checkpoints at scale (issue 24, item 4): each data-parallel rank writes its own slice of the weights
(zero_pp_rank_{dp}_mp_rank_00_model_states.pt); the model-states file holds the buffers and the slices' layout;
the whole model is gathered only with stage3_gather_16bit_weights_on_model_save. Loads at the saving layout copy
only the ranges each rank owns; any other load (data-parallel size, the tools) assembles a parameter at a time.
Host memory per rank during a save and a load stays within its share of the checkpoint plus the largest tensor
(measured as tools/bench/bench_checkpoint.py --zero3-memory does)."""
import os
import sys

import pytest
import torch

from megatron import zero
from megatron.checkpoint import layout as ckpt
from megatron.spawn import run_distributed
from tests.helpers import TinyNet, engine_train_step, max_relative_difference, param_groups, REPO

sys.path.insert(0, os.path.join(REPO, "tools", "bench"))
from bench_checkpoint import zero3_memory_worker  # noqa: E402

SAVE_AT, MORE, GLOBAL_BATCH = 3, 3, 8


def _engine(gather=False):
    model = TinyNet()
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": gather}}
    import torch.distributed as dist
    config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // dist.get_world_size()
    return zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2), config=config,
                           dist_init_required=False)[0]


def _weights(engine):
    parameters = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in parameters]):
        return {name: p.detach().clone() for name, p in parameters}


def _straight_and_save(save_dir, gathered_dir):
    engine = _engine()
    for step in range(SAVE_AT):
        engine_train_step(engine, step, GLOBAL_BATCH)
    saved_weights = _weights(engine)
    engine.save_checkpoint(save_dir, tag="t")
    losses = [engine_train_step(engine, step, GLOBAL_BATCH) for step in range(SAVE_AT, SAVE_AT + MORE)]
    gathered = _engine(gather=True)
    engine_train_step(gathered, 0, GLOBAL_BATCH)
    gathered.save_checkpoint(gathered_dir, tag="t")
    return saved_weights, losses, _weights(engine)


def _resume(save_dir):
    engine = _engine()
    engine.load_checkpoint(save_dir, tag="t")
    losses = [engine_train_step(engine, step, GLOBAL_BATCH) for step in range(SAVE_AT, SAVE_AT + MORE)]
    return losses, _weights(engine)


def _weights_only(save_dir):
    """The weights a load without the optimizer states gives (they come from the slices alone: with the
    optimizer states, fp32 masters would restore them too)."""
    engine = _engine()
    engine.load_checkpoint(save_dir, tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)
    return _weights(engine)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3_ckpt")
    save_dir, gathered_dir = str(root / "partitioned"), str(root / "gathered")
    return save_dir, gathered_dir, run_distributed(_straight_and_save, 2, args=(save_dir, gathered_dir))[0]


def test_each_rank_writes_its_own_slice_of_the_weights(saved):
    save_dir, gathered_dir, (weights, _, _) = saved
    tag = os.path.join(save_dir, "t")
    model_states = ckpt.safe_torch_load(os.path.join(tag, "mp_rank_00_model_states.pt"))
    assert not set(model_states[ckpt.MODULE]) & set(weights)         # no parameter in the model-states file
    record = model_states[ckpt.STAGE3_PARTITIONS]
    assert [len(group["names"]) for group in record] == [len(g["params"]) for g in param_groups(TinyNet())]
    for group, names in enumerate(group["names"] for group in record):
        numel = sum(weights[name].numel() for name in names)
        slices = [ckpt.safe_torch_load(os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
                  [ckpt.PARTITION_WEIGHTS][group] for r in (0, 1)]
        assert (slices[0][ckpt.START], slices[0][ckpt.END], slices[1][ckpt.END]) == \
            (0, slices[1][ckpt.START], numel)                          # contiguous, unpadded, covering the group
        flat = torch.cat([s[ckpt.WEIGHT] for s in slices])
        assert torch.equal(flat, torch.cat([weights[name].reshape(-1) for name in names]))
    gathered = ckpt.safe_torch_load(os.path.join(gathered_dir, "t", "mp_rank_00_model_states.pt"))
    assert set(weights) <= set(gathered[ckpt.MODULE]) and ckpt.STAGE3_PARTITIONS not in gathered


def test_resume_from_the_slices_is_bitwise(saved):
    save_dir, _, (weights, losses, final) = saved
    resumed_losses, resumed = run_distributed(_resume, 2, args=(save_dir,))[0]
    assert resumed_losses == losses
    assert max_relative_difference(resumed, final) == 0.0
    loaded = run_distributed(_weights_only, 2, args=(save_dir,))[0]
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[n], weights[n]) for n in weights)


def test_other_data_parallel_size_and_tools_read_the_slices(saved, tmp_path):
    """dp 1 re-partitions the slices (1e-6: the reduction order changes); zero_to_fp32 assembles them."""
    save_dir, _, (weights, losses, final) = saved
    resumed_losses, resumed = run_distributed(_resume, 1, args=(save_dir,))[0]
    assert max_relative_difference(resumed_losses, losses) <= 1e-6
    assert max_relative_difference(resumed, final) <= 1e-6
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import zero_to_fp32
    zero_to_fp32.consolidate(save_dir, str(tmp_path / "fp32.pt"), tag="t")
    consolidated = torch.load(str(tmp_path / "fp32.pt"), weights_only=True)
    assert consolidated.keys() == weights.keys()
    assert all(torch.equal(consolidated[name], weights[name]) for name in weights)   # fp32: masters = weights


def test_save_and_load_host_memory_per_rank_within_its_share_plus_the_largest_tensor(tmp_path):
    """4 x 1024^2 fp32 layers at dp 2: share 33.6 MB per rank (16 B per parameter: the weights slice, fp32
    master, two Adam moments), largest tensor 4.2 MB. A save that gathered the model on rank 0 would add the
    whole 16.8 MB of weights there."""
    results = run_distributed(zero3_memory_worker, 2, args=(str(tmp_path / "ckpt"), 4, 1024, False))
    for rank, result in enumerate(results):
        bound = result["share"] + result["largest"]
        assert result["save"] <= bound and result["load"] <= bound, (rank, result)
