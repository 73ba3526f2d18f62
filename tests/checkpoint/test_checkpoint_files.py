"""Megatron-path checkpoint files: what each load flag restores, and a clear message for each bad input.

One single-rank worker saves a tiny model once, then builds fresh model/optimizer/scheduler objects with
megatron.training.setup_model_and_optimizer under different flags (get_args() is mutable in the worker) and loads.
"""
import contextlib
import io
import os
import pickle
import shutil
import sys
import types

import pytest
import torch

from megatron.spawn import free_port, run_distributed

from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE
from tests import warm_python


TINY = MOCK_VOCAB + TINY_SHAPE + ["--batch-size", "2", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--log-interval", "100", "--eval-iters", "0", "--lr-decay-iters", "100",
        "--warmup", "0.1"]
ITERS = 4


class RunsCode:
    """Unpickling this calls open(marker, 'w'): a file that would run code when loaded with weights_only=False."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _save_once(save_dir, extra=()):
    import pretrain_gpt
    pretrain_gpt.main(TINY + ["--train-iters", str(ITERS), "--save", save_dir] + list(extra))
    from megatron.global_vars import get_args
    return get_args()


def _fresh_load(args, **flags):
    """Set flags on the global args, build fresh objects and load args.load; restore the flags afterwards."""
    import pretrain_gpt
    from megatron.training import setup_model_and_optimizer
    saved = {key: getattr(args, key) for key in flags}
    for key, value in flags.items():
        setattr(args, key, value)
    try:
        model, optimizer, lr_scheduler, state = setup_model_and_optimizer(pretrain_gpt.model_provider)
        counters = (state.iteration, state.consumed_train_samples, state.consumed_valid_samples,
                    state.skipped_iterations)
        return model, optimizer, lr_scheduler, counters
    finally:
        for key, value in saved.items():
            setattr(args, key, value)


def _flag_checks(save_dir):
    from megatron.train_state import CheckpointOptions, TrainState
    from megatron.checkpoint import CheckpointError, save_checkpoint
    from megatron.utils import unwrap_model
    args = _save_once(save_dir)
    saved = torch.load(os.path.join(save_dir, f"iter_{ITERS:07d}", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=True)
    saved_lr = saved["optimizer"]["param_groups"][0]["lr"]
    args.load = save_dir

    def weights_equal(model):
        return all(torch.equal(v, saved["model"][k]) for k, v in unwrap_model(model).state_dict().items())

    # Default: everything continues.
    model, optimizer, lr_scheduler, counters = _fresh_load(args)
    assert counters == (ITERS, ITERS * 2, 0, 0)
    assert weights_equal(model) and len(optimizer.state) > 0 and lr_scheduler.num_iters == ITERS
    assert optimizer.param_groups[0]["lr"] == saved_lr
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])

    # --finetune: weights only; counters, optimizer, scheduler and RNG start fresh.
    model, optimizer, lr_scheduler, counters = _fresh_load(args, finetune=True)
    assert counters == (0, 0, 0, 0)
    assert weights_equal(model) and len(optimizer.state) == 0 and lr_scheduler.num_iters == 0
    assert optimizer.param_groups[0]["lr"] == 0.0  # start of the warmup
    assert not torch.equal(torch.get_rng_state(), saved["rng"]["torch"])

    # --finetune in bf16: the fp32 master weights are the loaded weights, not the fresh initialization.
    model, optimizer, _, _ = _fresh_load(args, finetune=True, bf16=True, params_dtype="bfloat16")
    for name, param in unwrap_model(model).named_parameters():
        assert torch.equal(param, saved["model"][name].bfloat16()), name
    assert all(torch.equal(master, param.float()) for master, param in zip(optimizer.master_params,
                                                                           optimizer.model_params))

    # --no-load-optim: counters continue, optimizer and scheduler fresh; --no-load-rng: seeded RNG kept.
    model, optimizer, lr_scheduler, counters = _fresh_load(args, no_load_optim=True, no_load_rng=True)
    assert counters == (ITERS, ITERS * 2, 0, 0)
    assert weights_equal(model) and len(optimizer.state) == 0 and lr_scheduler.num_iters == 0
    assert not torch.equal(torch.get_rng_state(), saved["rng"]["torch"])

    # A different --lr: an error naming the field, unless a flag says which schedule wins.
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt: lr scheduler max_lr: command line 0.002"):
        _fresh_load(args, lr=2e-3)
    _, optimizer, lr_scheduler, _ = _fresh_load(args, lr=2e-3, override_lr_scheduler=True)
    assert (lr_scheduler.max_lr, lr_scheduler.num_iters) == (2e-3, ITERS)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * saved_lr, rel=1e-12)
    _, optimizer, lr_scheduler, _ = _fresh_load(args, lr=2e-3, use_checkpoint_lr_scheduler=True)
    assert (lr_scheduler.max_lr, lr_scheduler.num_iters) == (1e-3, ITERS)
    assert optimizer.param_groups[0]["lr"] == saved_lr

    # Re-saving an existing iteration replaces it; if a crash falls between moving the old copy aside (.old) and
    # renaming the new one into place, loading falls back to the .old copy.
    model, optimizer, lr_scheduler, _ = _fresh_load(args)
    save_checkpoint(TrainState(iteration=ITERS, consumed_train_samples=ITERS * 2), model, optimizer, lr_scheduler,
                    CheckpointOptions.from_args(args))
    assert sorted(os.listdir(save_dir)) == [f"iter_{ITERS:07d}", "latest_checkpointed_iteration.txt"]
    os.rename(os.path.join(save_dir, f"iter_{ITERS:07d}"), os.path.join(save_dir, f"iter_{ITERS:07d}.old"))
    model, _, _, counters = _fresh_load(args)
    assert counters == (ITERS, ITERS * 2, 0, 0) and weights_equal(model)


def test_load_flags_restore_what_they_promise(tmp_path):
    run_distributed(_flag_checks, 1, args=(str(tmp_path / "save"),))


def _write(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


def _bad_input_checks(root):
    """Each bad input raises CheckpointError with its message; returns nothing (asserts here)."""
    from megatron.train_state import CheckpointOptions
    from megatron.checkpoint import CheckpointError, load_checkpoint
    import pretrain_gpt
    save_dir = os.path.join(root, "save")
    args = _save_once(save_dir)
    iteration_dir = os.path.join(save_dir, f"iter_{ITERS:07d}")
    os.remove(os.path.join(iteration_dir, "manifest.json"))  # checks of a checkpoint saved before manifests
    good_file = os.path.join(iteration_dir, "mp_rank_00", "model_optim_rng.pt")
    good_bytes = open(good_file, "rb").read()
    from megatron.training import setup_model_and_optimizer
    args.load = None
    model, optimizer, lr_scheduler, _ = setup_model_and_optimizer(pretrain_gpt.model_provider)
    args.num_layers, args.hidden_size = 3, 64
    other_shape = setup_model_and_optimizer(pretrain_gpt.model_provider)[:3]
    args.num_layers, args.hidden_size = 2, 32

    def load(load_dir, objects=(model, optimizer, lr_scheduler)):
        return load_checkpoint(*objects, CheckpointOptions.from_args(types.SimpleNamespace(**{**vars(args),
                                                                                             "load": load_dir})))

    def expect(message, load_dir=save_dir, objects=(model, optimizer, lr_scheduler)):
        with pytest.raises(CheckpointError, match=message):
            load(load_dir, objects)

    # No tracker: start from scratch with a one-line notice.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert load(os.path.join(root, "empty")).iteration == 0
    assert out.getvalue().count("\n") == 1 and "will start from random" in out.getvalue()

    # Another model shape or model-parallel size: the file and every mismatched field.
    expect(r"model_optim_rng.pt was saved by another model shape: num_layers 2 \(checkpoint\) != 3 \(this run\); "
           r"hidden_size 32 \(checkpoint\) != 64 \(this run\)", objects=other_shape)
    shutil.copytree(iteration_dir, os.path.join(root, "mp2", f"iter_{ITERS:07d}"))
    os.rename(os.path.join(root, "mp2", f"iter_{ITERS:07d}", "mp_rank_00"),
              os.path.join(root, "mp2", f"iter_{ITERS:07d}", "mp_rank_01"))
    _write(os.path.join(root, "mp2", "latest_checkpointed_iteration.txt"), str(ITERS).encode())
    expect(r"the shards of model-parallel ranks \[0\] are missing \(found \[1\]\)", os.path.join(root, "mp2"))

    # Tracker problems.
    tracker = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    _write(tracker, b"12x")
    expect(r"latest_checkpointed_iteration.txt holds '12x'")
    _write(tracker, b"99")
    expect(r"names iteration 99, but .*iter_0000099 does not exist")
    _write(tracker, str(ITERS).encode())

    # Damaged files.
    for data, message in [(good_bytes[:len(good_bytes) // 2], "is truncated or corrupt"), (b"", "is empty"),
                          (os.urandom(4096), "is corrupt: not a torch.save zip archive")]:
        _write(good_file, data)
        expect(f"{good_file} {message}")

    # Saved without optimizer / RNG state, loaded without --no-load-optim / --no-load-rng.
    for key, flag in (("optimizer", "--no-load-optim"), ("rng", "--no-load-rng")):
        state = torch.load(io.BytesIO(good_bytes), weights_only=True)
        del state[key]
        torch.save(state, good_file)
        expect(f"{good_file} has no {key}.* pass {flag}")

    # A file that would run code when unpickled: refused, and the code does not run.
    marker = os.path.join(root, "code_ran")
    torch.save({"iteration": ITERS, "model": RunsCode(marker)}, good_file)
    expect(f"refusing to load {good_file}: weights_only loading found Unsupported global")
    with open(good_file, "wb") as handle:
        pickle.dump({"iteration": ITERS, "model": RunsCode(marker)}, handle)
    expect(f"{good_file} is corrupt")  # not even a zip archive
    assert not os.path.exists(marker), "loading the checkpoint ran code"
    pickle.loads(pickle.dumps(RunsCode(marker + ".control")))  # control: unpickled unsafely, the payload runs
    assert os.path.exists(marker + ".control")


def test_bad_inputs_give_clear_errors(tmp_path):
    run_distributed(_bad_input_checks, 1, args=(str(tmp_path),))


def test_bad_checkpoint_exits_nonzero_with_message(tmp_path):
    os.makedirs(tmp_path / "save")
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("7")
    env = dict(os.environ, MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0")
    result = warm_python.run([sys.executable, "pretrain_gpt.py"] + TINY + ["--train-iters", "1", "--load",
                                                                            str(tmp_path / "save")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"names iteration 7, but {tmp_path / 'save' / 'iter_0000007'} does not exist" in result.stderr
