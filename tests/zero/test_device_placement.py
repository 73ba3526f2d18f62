"""A client's model goes to the device (issue 53 row 1): DeepSpeed 0.19.8's engine does `self.module.to(self.device)`
before partitioning, and its zero.Init builds on the local accelerator. On a CPU-only machine the host and the
"device" are the same, so mpu's device source is made to answer "meta": whatever stays on the CPU is then visible.
The reference is that answer itself (the device mpu reports), not anything the engine computes."""
import pytest
import torch
from torch import nn

import mpu.utils
from tests.zero.test_nccl_rules import meta_rank  # noqa: F401  (the fixture: fake dp 2, "meta", the rules on)

META = torch.device("meta")
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6}


class HostNet(nn.Module):
    """Built on the CPU as Hugging Face and DeepSpeed-Chat build theirs: parameters and a buffer (nn.Module.to
    moves both; the buffer is what a parameter-only move would leave behind)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6, device="cpu")
        self.fc2 = nn.Linear(6, 3, device="cpu")
        self.register_buffer("scale", torch.ones(3, device="cpu"))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


@pytest.fixture
def meta_device(monkeypatch):
    """mpu's one device source answers "meta" (the engine and zero.Init look it up when they are built)."""
    monkeypatch.setattr(mpu.utils, "get_device", lambda: META)
    return META


def _devices(module):
    return {t.device for t in list(module.parameters()) + list(module.buffers())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_host_built_model_moves_to_the_device(meta_device, stage):
    from megatron import zero
    model = HostNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero_config = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    engine, wrapped, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                            config={**CONFIG, "zero_optimization": zero_config})
    assert engine.device == meta_device
    assert _devices(engine.module) == {meta_device}
    assert wrapped.collective_device == meta_device
    assert {g.device for g in wrapped.groups} == {meta_device}     # stage 3: the partitions; else the flat buffers
    # the flat groups hold the module's parameters (moving to meta replaces the Parameter objects)
    assert {id(p) for g in wrapped.groups for p in g.params} == {id(p) for p in engine.module.parameters()}


def test_an_engine_without_optimizer_moves_the_model_too(meta_device):
    from megatron import zero
    engine, _, _, _ = zero.initialize(model=HostNet(), config={**CONFIG, "zero_optimization": {"stage": 0}})
    assert engine.device == meta_device and _devices(engine.module) == {meta_device}


def test_zero_init_builds_on_the_device(meta_device):
    """Constructors inside zero.Init default to the device (parameters and buffers), and the pieces stay there
    without remote_device. (A parameter built on the host explicitly: the next test.)"""
    from megatron import zero
    with zero.Init():
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    assert {p.ds_tensor.device for p in model.parameters()} == {meta_device}
    assert {p.device for p in model.parameters()} == {meta_device}
    assert {b.device for b in model.buffers()} == {meta_device}


class HostParameter(nn.Parameter):
    """A parameter built on the host that takes device data in place (`param.data = ...`) as a CPU parameter takes
    CUDA data. torch refuses CPU -> "meta" in place (incompatible tensor types): the contents are swapped instead,
    the object and its attributes kept, so zero.Init's own code runs unchanged on the "meta" device."""

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        attributes = dict(self.__dict__)
        torch.utils.swap_tensors(self, nn.Parameter(value, requires_grad=self.requires_grad))
        self.__dict__.update(attributes)


class HostBuiltNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = HostParameter(torch.ones(3, 5, device="cpu"))     # on the host explicitly


def test_a_host_built_parameter_in_zero_init_goes_to_the_device_before_any_collective(meta_rank):
    """Fake dp 2 on the "meta" device under the NCCL rules: zero.Init moves a parameter built on the host to the
    device before it broadcasts it (on NCCL a host tensor there fails; on gloo the host is the device, so only
    here is it visible), and the parameter and its piece end on the device."""
    from megatron import zero
    from megatron.guards import nccl_rules
    before = nccl_rules.checked
    with zero.Init():
        model = HostBuiltNet()
    assert nccl_rules.checked > before              # its broadcast went through the rules (a host tensor raises)
    weight = model.weight
    assert (weight.device, weight.ds_tensor.device, weight.ds_shape, weight.ds_tensor.numel()) == \
        (META, META, torch.Size([3, 5]), 8)          # 15 elements in 2 pieces of 8


def test_a_zero_init_model_is_partitioned_on_the_device(meta_device):
    """Stage 3 gathers zero.Init's pieces into partitions on the engine's device and does not move the module."""
    from megatron import zero
    with zero.Init():
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    engine, wrapped, _, _ = zero.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={**CONFIG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    assert engine.device == meta_device
    assert {g.device for g in wrapped.groups} == {meta_device}


def test_on_the_cpu_the_device_is_the_cpu():
    from megatron import zero
    engine, _, _, _ = zero.initialize(model=HostNet(), config={**CONFIG, "zero_optimization": {"stage": 0}})
    assert engine.device == mpu.utils.get_device() == torch.device("cpu")

