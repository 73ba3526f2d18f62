"""Engine checkpoints: exact resume at the same data-parallel size, re-partitioning to 1 and 4, client_state,
weights-only loading, the atomic/safe file helpers, and the seed tutorial's megatron.utils names."""
import os
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron import zero
from megatron.checkpoint import layout as ckpt
from megatron.spawn import run_distributed
from tests.helpers import engine_train_step, max_relative_difference, param_groups, TinyNet

GLOBAL_BATCH, MICRO, SAVE_AT, MORE = 8, 2, 3, 3


def _config(stage=2):
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "gradient_clipping": 0.5, "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                               "total_num_steps": 20, "warmup_type": "linear"}}}


def _engine(stage=2):
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model))
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=_config(stage),
                                      dist_init_required=False)
    return engine


def _run(engine, start, steps):
    return [engine_train_step(engine, step, GLOBAL_BATCH) for step in range(start, start + steps)]


def _state(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _straight_and_save(save_dir):
    engine = _engine(stage=2)
    _run(engine, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag=f"iter_{SAVE_AT}",
                           client_state={"iteration": SAVE_AT, "rng": torch.arange(3), "note": "hello"})
    losses = _run(engine, SAVE_AT, MORE)
    return losses, _state(engine), engine.get_lr()


def _resume(save_dir, stage):
    engine = _engine(stage=stage)
    path, client_state = engine.load_checkpoint(save_dir)
    assert engine.global_steps == SAVE_AT
    losses = _run(engine, SAVE_AT, MORE)
    return path, client_state, losses, _state(engine), engine.get_lr()


def _resume_weights_only(save_dir):
    engine = _engine(stage=1)
    reference = _engine(stage=1)
    path, client_state = engine.load_checkpoint(save_dir, load_optimizer_states=False,
                                                load_lr_scheduler_states=False)
    saved = ckpt.safe_torch_load(path)[ckpt.MODULE]
    weights_equal = all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    no_moments = len(engine.optimizer.state) == 0
    lr_untouched = engine.get_lr() == reference.get_lr()
    master_follows = all(torch.equal(m, g.own_partition().float()) for m, g in
                         zip(engine.optimizer.masters, engine.optimizer.groups))
    return weights_equal, no_moments, lr_untouched, master_follows, client_state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("zero_ckpt"))
    results = run_distributed(_straight_and_save, 2, args=(save_dir,))
    return save_dir, results[0]


def test_layout_and_latest(saved):
    save_dir, _ = saved
    tag_dir = os.path.join(save_dir, f"iter_{SAVE_AT}")
    assert sorted(os.listdir(tag_dir)) == ["manifest.json", "mp_rank_00_model_states.pt",
                                           "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                           "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert open(os.path.join(save_dir, "latest")).read() == f"iter_{SAVE_AT}"
    assert not [f for f in os.listdir(save_dir) if ".tmp." in f]
    optim = ckpt.safe_torch_load(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    numel = sum(p.numel() for p in TinyNet().parameters())
    slices = [g["end"] - g["start"] for g in optim["groups"]]
    assert all(g["fp32_master"].numel() == g["end"] - g["start"] for g in optim["groups"])   # unpadded
    assert 0 < sum(slices) < numel


def test_resume_same_data_parallel_size_is_bitwise(saved):
    save_dir, (losses, state, lr) = saved
    path, client_state, resumed_losses, resumed_state, resumed_lr = run_distributed(_resume, 2,
                                                                                    args=(save_dir, 2))[0]
    assert path.endswith("mp_rank_00_model_states.pt")
    assert resumed_losses == losses
    assert max_relative_difference(resumed_state, state) == 0.0
    assert resumed_lr == lr
    assert client_state["iteration"] == SAVE_AT and client_state["note"] == "hello"
    assert torch.equal(client_state["rng"], torch.arange(3))


@pytest.mark.parametrize("world_size,stage", [(1, 2), (4, 1)])
def test_resume_at_other_data_parallel_sizes(saved, world_size, stage):
    save_dir, (losses, state, lr) = saved
    results = run_distributed(_resume, world_size, args=(save_dir, stage))
    _, _, resumed_losses, resumed_state, resumed_lr = results[0]
    assert max_relative_difference(resumed_losses, losses) <= 1e-6
    assert max_relative_difference(resumed_state, state) <= 1e-6
    assert resumed_lr == lr


def test_load_module_weights_only(saved):
    save_dir, _ = saved
    weights_equal, no_moments, lr_untouched, master_follows, client_state = \
        run_distributed(_resume_weights_only, 1, args=(save_dir,))[0]
    assert weights_equal and no_moments and lr_untouched and master_follows
    assert client_state["iteration"] == SAVE_AT


def test_missing_checkpoint_returns_none(tmp_path):
    engine = _engine()
    assert engine.load_checkpoint(str(tmp_path)) == (None, {})


def test_atomic_helpers_and_safe_load(tmp_path):
    path = str(tmp_path / "state.pt")
    ckpt.atomic_torch_save({"a": torch.ones(2), "b": [1, 2.5, "x", None], "c": (3, 4)}, path)
    loaded = ckpt.safe_torch_load(path)
    assert torch.equal(loaded["a"], torch.ones(2)) and loaded["c"] == (3, 4)
    ckpt.atomic_write_text(str(tmp_path / "latest"), "iter_7")
    assert open(tmp_path / "latest").read() == "iter_7"
    assert sorted(os.listdir(tmp_path)) == ["latest", "state.pt"]
    with pytest.raises(ckpt.CheckpointError, match=r"\['rng'\] holds a numpy.ndarray"):
        ckpt.atomic_torch_save({"rng": np.zeros(3)}, str(tmp_path / "bad.pt"))
    assert not os.path.exists(tmp_path / "bad.pt")
    torch.save({"x": np.zeros(3)}, str(tmp_path / "unsafe.pt"))     # written without the helper
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.safe_torch_load(str(tmp_path / "unsafe.pt"))
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.safe_torch_load(str(tmp_path / "nothing.pt"))


def _save_stage0(save_dir):
    engine = _engine(stage=0)
    _run(engine, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="stage0")
    return _run(engine, SAVE_AT, MORE)


def _resume_stage0(save_dir):
    engine = _engine(stage=0)
    engine.load_checkpoint(save_dir)
    return _run(engine, SAVE_AT, MORE)


def test_stage0_resume_reads_one_optimizer_file(tmp_path):
    """Stage 0 files are full copies: loading needs (and reads) only data-parallel rank 0's."""
    save_dir = str(tmp_path)
    losses = run_distributed(_save_stage0, 2, args=(save_dir,))[0]
    os.remove(os.path.join(save_dir, "stage0", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    resumed = run_distributed(_resume_stage0, 1, args=(save_dir,))[0]
    assert max_relative_difference(resumed, losses) <= 1e-6


def _save_with_rank_1_failing(save_dir):
    """Rank 1's optimizer-state write fails: every rank must raise (none waits in a collective), `latest` untouched."""
    engine = _engine()
    _run(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    if dist.get_rank() == 1:
        def failing_save(obj, path):
            raise OSError(f"No space left on device: {path}")
        ckpt.atomic_torch_save, original = failing_save, ckpt.atomic_torch_save
    try:
        engine.save_checkpoint(save_dir, tag="bad")
        return "saved"
    except ckpt.CheckpointError as error:
        return str(error)
    finally:
        if dist.get_rank() == 1:
            ckpt.atomic_torch_save = original


def test_a_failed_write_on_one_rank_raises_everywhere(tmp_path):
    messages = run_distributed(_save_with_rank_1_failing, 2, args=(str(tmp_path),))
    assert "No space left on device" in messages[1] and "another rank failed" in messages[0]
    assert open(os.path.join(str(tmp_path), ckpt.LATEST_FILE)).read() == "good"


def _tutorial_save_then_load(save_dir):
    """The seed tutorial's calls, megatron.utils.save_ds_checkpoint(iteration, model, args) and
    load_checkpoint(model, optimizer, lr_scheduler, args), on a ZeRO-2 engine: (what the load returned, the engine's
    steps after it, weights equal, the torch RNG draw after the save and after the load)."""
    from megatron import utils
    args = types.SimpleNamespace(save=save_dir, load=save_dir, save_keep_last=None, no_save_optim=False,
                                 no_save_rng=False, no_load_optim=False, no_load_rng=False, finetune=False)
    engine = _engine()
    _run(engine, 0, 2)
    utils.save_ds_checkpoint(7, engine, args)       # the loop's iteration, not the engine's 2 steps
    weights, draw_after_save = _state(engine), torch.rand(3)
    fresh = _engine()
    torch.manual_seed(99)
    train_state = utils.load_checkpoint(fresh, fresh.optimizer, None, args)
    weights_equal = all(torch.equal(v, weights[k]) for k, v in _state(fresh).items())
    return train_state, fresh.global_steps, weights_equal, draw_after_save, torch.rand(3)


def test_tutorial_names_in_utils_save_and_load_through_megatron_checkpoint(tmp_path):
    """megatron.utils keeps the tutorial's save_ds_checkpoint and load_checkpoint, delegating to
    megatron.checkpoint: the iteration passed in is the one tracked and read back, the RNG states restored."""
    from megatron.train_state import TrainState
    train_state, steps, weights_equal, draw_after_save, draw_after_load = \
        run_distributed(_tutorial_save_then_load, 1, args=(str(tmp_path),), model_parallel_size=1)[0]
    assert ckpt.read_tracker(str(tmp_path)) == (7, False)
    assert os.path.isdir(tmp_path / "iter_0000007")
    assert train_state == TrainState(iteration=7) and steps == 2 and weights_equal
    assert torch.equal(draw_after_load, draw_after_save)
