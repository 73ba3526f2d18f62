"""megatron/checkpoint/deepspeed_format.py and deepspeed_classes.py at unit level, on tiny files (no engine, no
training): the loss-scaler stand-ins are pickled under DeepSpeed's class names (dynamic as DynamicLossScaler, static
as LossScaler) and real DeepSpeed 0.19.8 unpickles them as its own classes; a scaler mid-hysteresis (ours, or
DeepSpeed's own after one overflow) reads back with the hysteresis budget it has left, not its full budget; a
DeepSpeed model-states file of 4 global steps at gradient accumulation 3 reads as 12 micro steps."""
import importlib.util
import os
import pickletools
import types
import zipfile

import pytest
import torch

from megatron.checkpoint import deepspeed_format as dsf
from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.deepspeed_classes import DeepSpeedDynamicLossScaler, DeepSpeedLossScaler
from megatron.fp16.loss_scaler import LossScaler, LossScalerConfig

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is a test requirement: pip install -r "
                                                               "requirements-test.txt (DS_BUILD_OPS=0)")
DS_SCALERS = "deepspeed.runtime.fp16.loss_scaler"


def _mid_hysteresis_scaler():
    """Our dynamic scaler (2**4, hysteresis 2) after one overflow: scale kept, one overflow of budget left."""
    scaler = LossScaler(LossScalerConfig(initial_scale_power=4, loss_scale_window=1000, hysteresis=2))
    scaler.update(True)
    assert scaler.state_dict() == {"scale": 16.0, "iteration": 1, "last_overflow_iteration": 0,
                                   "hysteresis_left": 1, "dynamic": True}
    return scaler


def _stage3_optimizer_file(directory, scaler):
    """A stage-3 optimizer-states file holding `scaler` as DeepSpeed's object, written as the engine writes it."""
    state = dsf.optimizer_state_dict(3, 1, [torch.zeros(4)], [{}], [{"step": 1}], [{"lr": 0.1}], scaler)
    path = os.path.join(directory, ckpt.optim_states_name(0, 0))
    ckpt.atomic_torch_save({dsf.OPTIMIZER_STATE_DICT: state}, path)
    return path


def _pickled_classes(path):
    """'module.name' of every global the pickle of a torch.save file names."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl")))
    names, strings = [], []
    for opcode, argument, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            names.append(argument.replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":
            names.append(".".join(strings[-2:]))
        elif isinstance(argument, str):
            strings.append(argument)
    return names


@pytest.mark.parametrize("dynamic", [True, False])
def test_loss_scaler_is_pickled_under_deepspeeds_class_name(tmp_path, dynamic):
    scaler = _mid_hysteresis_scaler() if dynamic else LossScaler(LossScalerConfig(loss_scale=8.0))
    path = _stage3_optimizer_file(str(tmp_path), scaler)
    expected = f"{DS_SCALERS}.DynamicLossScaler" if dynamic else f"{DS_SCALERS}.LossScaler"
    assert [name for name in _pickled_classes(path) if name.startswith("deepspeed.")] == [expected]
    read = ckpt.safe_torch_load(path)[dsf.OPTIMIZER_STATE_DICT][ckpt.LOSS_SCALER]
    assert type(read) is (DeepSpeedDynamicLossScaler if dynamic else DeepSpeedLossScaler)
    ours = dsf.our_loss_scaler_state(read)
    if dynamic:
        assert ours == scaler.state_dict()
    else:                           # a static scale: no counters or hysteresis to carry
        assert (ours["scale"], ours["dynamic"]) == (8.0, False)


@needs_deepspeed
def test_deepspeed_unpickles_our_scalers_as_its_own_classes(tmp_path):
    from tests.zero.test_deepspeed_oracle import _deepspeed
    _deepspeed()
    from deepspeed.runtime.fp16 import loss_scaler as ds
    assert ds.__name__ == DS_SCALERS
    os.makedirs(tmp_path / "dynamic")
    os.makedirs(tmp_path / "static")
    dynamic = torch.load(_stage3_optimizer_file(str(tmp_path / "dynamic"), _mid_hysteresis_scaler()),
                         weights_only=False)[dsf.OPTIMIZER_STATE_DICT][ckpt.LOSS_SCALER]
    static = torch.load(_stage3_optimizer_file(str(tmp_path / "static"), LossScaler(LossScalerConfig(loss_scale=8.0))),
                        weights_only=False)[dsf.OPTIMIZER_STATE_DICT][ckpt.LOSS_SCALER]
    assert type(dynamic) is ds.DynamicLossScaler and type(static) is ds.LossScaler
    assert (dynamic.loss_scale, dynamic.dynamic, dynamic.cur_iter, dynamic.last_overflow_iter) == (16.0, True, 1, 0)
    assert (dynamic.cur_hysteresis, dynamic.delayed_shift, dynamic.scale_window) == (1, 2, 1000)
    assert (static.loss_scale, static.dynamic) == (8.0, False)


def test_a_scaler_mid_hysteresis_reads_the_budget_it_has_left():
    stand_in = dsf.deepspeed_loss_scaler(_mid_hysteresis_scaler())
    assert (stand_in.cur_hysteresis, stand_in.delayed_shift) == (1, 2)
    assert dsf.our_loss_scaler_state(stand_in)["hysteresis_left"] == 1


@needs_deepspeed
def test_deepspeeds_own_scaler_mid_hysteresis_reads_as_ours(monkeypatch):
    """DeepSpeed's DynamicLossScaler after its own update_scale(overflow) (its rank-0 log line stubbed out: no
    process group) reads as our scaler after the same overflow."""
    from tests.zero.test_deepspeed_oracle import _deepspeed
    _deepspeed()
    from deepspeed.runtime.fp16 import loss_scaler as ds
    monkeypatch.setattr(ds, "dist", types.SimpleNamespace(get_rank=lambda: 1))
    theirs = ds.DynamicLossScaler(init_scale=16.0, scale_window=1000, min_scale=1.0, delayed_shift=2,
                                  consecutive_hysteresis=False)
    theirs.update_scale(True)
    assert (theirs.cur_hysteresis, theirs.delayed_shift, theirs.cur_scale) == (1, 2, 16.0)
    assert dsf.our_loss_scaler_state(theirs) == _mid_hysteresis_scaler().state_dict()


def test_micro_steps_are_global_steps_times_gradient_accumulation(tmp_path):
    """A DeepSpeed model-states file (DeepSpeed's keys as our writer writes them, no optimizer files) of 4 global
    steps at gradient accumulation 3 reads as 12 micro steps."""
    module = torch.nn.Linear(2, 3)
    shapes = {name: param.shape for name, param in module.named_parameters()}
    state = dsf.model_states_keys(module, [list(shapes)], shapes, 1, 1, 1, global_steps=4, train_batch_size=6,
                                  ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    state.update({ckpt.MODULE: module.state_dict(), ckpt.GLOBAL_STEPS: 4, ckpt.SKIPPED_STEPS: 0})
    torch.save(state, os.path.join(tmp_path, ckpt.model_states_name(0)))
    read = dsf.load_model_states(str(tmp_path), 0)
    assert (read[ckpt.GLOBAL_STEPS], read[ckpt.MICRO_STEPS]) == (4, 12)
