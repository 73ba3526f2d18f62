"""NCCL's rules checked on the CPU (megatron/guards/nccl_rules.py): no collective on host offload memory or off the
rank's device, none before the device is bound; and `zero.initialize` binds the device before it starts
torch.distributed (DeepSpeed clients let it start the process group).

tests/conftest.py turns the rules on for the whole suite (MEGATRON_NCCL_RULES=1): every spawned worker and every
launched training script runs under them. Two matrices:
- on gloo at dp 2 (real values): ZeRO stages 0-3 x offload x fp32/bf16, contiguous_gradients + overlap_comm on and
  off at stages 2 and 3, losses equal to one process;
- on a "meta" device (only shapes and devices): on a CPU the host and gloo's "device" are the same, so a tensor
  left on the host is invisible there. Here mpu's device answers "meta" and rank 0 of 2 runs on torch's fake process
  group, in this process: every stage x offload x fp32/bf16/fp16 x contiguous_gradients/overlap_comm, a client model
  built on the CPU. A bucket allocated beside an offloaded partition, norm sums left beside offloaded gradients,
  a model the engine never moved: each puts a host tensor into a collective, refused by rule 1."""
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import mpu
from megatron import zero
from megatron.guards import nccl_rules
from megatron.spawn import run_distributed
from megatron.zero import offload
from megatron.zero.as_deepspeed import comm as deepspeed_comm
from tests.helpers import ds_config, engine_train_step, max_relative_difference, param_groups, reference_run, TinyNet

STEPS, MICRO, LR = 2, 2, 1e-2
META = torch.device("meta")
BUCKETS = {"plain": {}, "contiguous+overlap": {"contiguous_gradients": True, "overlap_comm": True}}
OFFLOADS = {0: [(False, False)], 1: [(False, False), (True, False)], 2: [(False, False), (True, False)],
            3: [(False, False), (True, False), (False, True), (True, True)]}   # (offload_optimizer, offload_param)

# gloo, real values: (stage, offload_optimizer, offload_param, precision, buckets)
MATRIX = [(stage, opt, param, precision, "plain") for stage in (0, 1, 2, 3) for opt, param in OFFLOADS[stage]
          for precision in ("fp32", "bf16")] + \
         [(stage, opt, param, "fp32", "contiguous+overlap") for stage in (2, 3) for opt, param in OFFLOADS[stage]]
# meta device, shapes only: the same with fp16 and both bucket modes everywhere
META_MATRIX = [(stage, opt, param, precision, buckets) for stage in (0, 1, 2, 3) for opt, param in OFFLOADS[stage]
               for precision in ("fp32", "bf16", "fp16") for buckets in BUCKETS]


def _config(stage, offload_optimizer, offload_param, precision, buckets="plain"):
    zero_options = dict(BUCKETS[buckets])
    if offload_optimizer:
        zero_options["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero_options["offload_param"] = {"device": "cpu"}
    config = ds_config(stage, MICRO, **zero_options)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _train_matrix():
    """Every config of MATRIX for STEPS steps; (rules installed?, {config: losses})."""
    losses = {}
    for row in MATRIX:
        model = TinyNet()
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
        engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=_config(*row),
                                          dist_init_required=False)
        losses[row] = [engine_train_step(engine, step, engine.train_batch_size()) for step in range(STEPS)]
    return getattr(dist.all_reduce, "_nccl_rules", False), losses


def test_every_stage_and_offload_runs_under_the_rules():
    """dp 2: no collective of any stage x offload x precision x bucket mode takes host offload memory; fp32 losses
    equal the single-process reference (1e-5), bf16 ones within 2e-2."""
    rules_on, losses = run_distributed(_train_matrix, world_size=2)[0]
    assert rules_on
    reference, _ = reference_run(STEPS, MICRO * 2, lr=LR)
    for row, values in losses.items():
        tolerance = 1e-5 if row[3] == "fp32" else 2e-2
        assert max_relative_difference(values, reference) <= tolerance, row


def _initialize_then_save(save_dir):
    """A DeepSpeed-style client: only torchrun's environment; zero.initialize starts torch.distributed, then a
    step and a save (object collectives: the manifest's gather)."""
    model = TinyNet()
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=LR),
                                      config=ds_config(2, MICRO))
    engine_train_step(engine, 0, engine.train_batch_size())
    engine.save_checkpoint(save_dir, tag="step1")
    return mpu.device_is_set(), dist.get_backend()


def test_initialize_binds_the_device_before_starting_torch_distributed(tmp_path):
    results = run_distributed(_initialize_then_save, world_size=2, args=(str(tmp_path),), init_process_group=False)
    assert results == [(True, "gloo")] * 2
    assert (tmp_path / "step1").is_dir()


def test_initialize_sets_the_cuda_device_of_local_rank_first(monkeypatch):
    """On a mocked 8-GPU machine running 2 processes per node, global RANK 3 is LOCAL_RANK 1 of the second node:
    torch.cuda.set_device(cuda:1) before init_process_group("nccl"). (RANK 3 -> cuda:3 would be the wrong GPU;
    with RANK == LOCAL_RANK, or RANK % device_count == LOCAL_RANK, that bug would not show.)"""
    from megatron.zero import builder
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(("init", backend)))
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    current = _mock_current_cuda_device(monkeypatch, 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: (calls.append(("set_device", torch.device(device))),
                                                                  current.__setitem__(0, torch.device(device).index)))
    assert mpu.get_device() == torch.device("cuda", 1)
    assert not mpu.device_is_set()
    builder._init_distributed()
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]
    assert mpu.device_is_set() and mpu.current_device() == torch.device("cuda", 1)


def _mock_current_cuda_device(monkeypatch, index):
    """torch.cuda.current_device() answers the list's item (a test's set_device changes it)."""
    current = [index]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return current


def test_bound_means_the_current_device_is_the_ranks(monkeypatch):
    """On a (mocked) 8-GPU machine at LOCAL_RANK 1, set_device having run once is not enough: a collective while the
    current CUDA device is cuda:0 (something switched it back) is refused naming both; on cuda:1 it passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    current = _mock_current_cuda_device(monkeypatch, 0)
    assert not mpu.device_is_set()
    with pytest.raises(nccl_rules.NcclRuleError, match=r"barrier .* the current device cuda:0, not this rank's device "
                                                       r"cuda:1"):
        nccl_rules.check("barrier", [])
    current[0] = 1
    assert mpu.device_is_set()
    nccl_rules.check("barrier", [])


def test_rules_refuse_offload_memory_and_an_unbound_device(monkeypatch):
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", True)
    on_device = torch.zeros(4)
    host = offload.host_zeros(8, torch.float32)
    nccl_rules.check("all_reduce", [on_device])
    with pytest.raises(nccl_rules.NcclRuleError, match=r"all_reduce called from .*test_nccl_rules.py.* host offload"):
        nccl_rules.check("all_reduce", [host[2:6]])          # a view of offload memory too
    with pytest.raises(nccl_rules.NcclRuleError, match="host offload"):
        nccl_rules.check("all_gather", [[on_device, host]])   # inside a list
    assert offload.is_host_offload(offload.to_device(host, torch.device("cpu"))) is False
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", False)
    with pytest.raises(nccl_rules.NcclRuleError, match="device is not bound"):
        nccl_rules.check("broadcast_object_list", [[{"a": 1}]])


def test_rules_refuse_a_tensor_off_the_device(monkeypatch):
    """On a (mocked) CUDA rank a CPU tensor in a collective is refused, naming both devices."""
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", True)
    monkeypatch.setattr(mpu, "get_device", lambda: torch.device("cuda", 1))
    _mock_current_cuda_device(monkeypatch, 1)
    with pytest.raises(nccl_rules.NcclRuleError, match=r"on cpu, not on this rank's device cuda:1"):
        nccl_rules.check("reduce", [torch.zeros(2)])


def test_rules_refuse_a_tensor_on_another_gpu_of_the_same_type(monkeypatch):
    """On a (mocked) cuda:0 rank, a (fake) tensor on cuda:1 is refused: the same device type is not enough. One on
    cuda:0 passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", True)
    monkeypatch.setattr(mpu, "get_device", lambda: torch.device("cuda", 0))
    _mock_current_cuda_device(monkeypatch, 0)
    with FakeTensorMode():
        own, other = torch.empty(2, device="cuda:0"), torch.empty(2, device="cuda:1")
    assert (own.device, other.device) == (torch.device("cuda", 0), torch.device("cuda", 1))
    nccl_rules.check("all_reduce", [own])
    with pytest.raises(nccl_rules.NcclRuleError, match=r"on cuda:1, not on this rank's device cuda:0"):
        nccl_rules.check("all_gather", [[own, other], own])


class _MetaValues(TorchDispatchMode):
    """Values of a "meta" run, where only shapes and devices matter: reading one gives 0, a copy to the host gives
    zeros, a copy from meta into a host tensor leaves the host tensor as it is. (The host side, offloaded masters
    and their optimizer, runs for real on those zeros.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and torch.is_tensor(args[0]) else None
        if func is torch.ops.aten._local_scalar_dense.default and source.is_meta:
            return 0.0 if source.dtype.is_floating_point else False if source.dtype == torch.bool else 0
        if func is torch.ops.aten._to_copy.default and source.is_meta and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        if func is torch.ops.aten.copy_.default and source.device.type == "cpu" and args[1].is_meta:
            return source
        return func(*args, **kwargs)


@pytest.fixture
def meta_rank(monkeypatch):
    """This process as rank 0 of 2 on torch's fake process group (collectives do nothing), its device "meta"
    (bound), under the rules (installed here, put back after)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for owner in (mpu, mpu.utils):
        monkeypatch.setattr(owner, "get_device", lambda: META)
    monkeypatch.setattr(mpu.utils, "_DEVICE_SET", True)
    already_on = getattr(dist.all_reduce, "_nccl_rules", False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    nccl_rules.install()
    try:
        with _MetaValues():
            yield
    finally:
        if not already_on:
            nccl_rules.uninstall()
        dist.destroy_process_group()


def _client_model():
    """TinyNet as a DeepSpeed client builds its model: on the CPU (the engine is to move it to the device)."""
    with mock.patch.object(mpu, "get_device", lambda: torch.device("cpu")):
        return TinyNet()


@pytest.mark.parametrize("row", META_MATRIX, ids=lambda row: "s{}-{}{}-{}-{}".format(
    row[0], "optimizer_offload-" if row[1] else "", "param_offload" if row[2] else "on_device", row[3], row[4]))
def test_no_host_tensor_reaches_a_collective_on_a_meta_device(meta_rank, row):
    """A client's CPU-built model, STEPS steps at (fake) dp 2 on the "meta" device: every collective's tensors are on
    the device (its model moved there, its buckets and norm sums too, also when partitions, gradients or masters
    live in host offload memory)."""
    model = _client_model()
    before = nccl_rules.checked
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=LR),
                                      config=_config(*row), dist_init_required=False)
    for step in range(STEPS):
        engine_train_step(engine, step, engine.train_batch_size())
    assert engine.device == META and {p.device for p in engine.module.parameters()} == {META}
    assert nccl_rules.checked > before          # the rules saw the engine's collectives


def test_deepspeed_comm_and_process_group_methods_are_checked(meta_rank):
    """A DeepSpeed client's `deepspeed.comm.all_reduce` (our alias, imported before the rules were installed) and a
    collective called as a ProcessGroup method are checked as `dist.all_reduce` is."""
    host = torch.zeros(4)
    on_device = torch.zeros(4, device=META)
    deepspeed_comm.all_reduce(on_device)
    with pytest.raises(nccl_rules.NcclRuleError, match=r"all_reduce called from .* on cpu, not on this rank's device "
                                                       r"meta"):
        deepspeed_comm.all_reduce(host)
    with pytest.raises(nccl_rules.NcclRuleError, match=r"broadcast .* on cpu"):
        deepspeed_comm.broadcast(host, src=0)
    group = dist.group.WORLD
    group.allreduce([on_device]).wait()
    with pytest.raises(nccl_rules.NcclRuleError, match=r"allreduce called from .* on cpu"):
        group.allreduce([host])
    with pytest.raises(nccl_rules.NcclRuleError, match=r"_allgather_base .* on cpu"):
        group._allgather_base(torch.zeros(8, device=META), host)


class _Handle:
    def __init__(self):
        self.waits = []

    def wait(self, *args, **kwargs):
        self.waits.append((args, kwargs))
        return True


def test_stage3_gathers_block_the_host_only_on_gloo():
    """NCCL: a plain wait() (the compute stream waits for the communication stream, the host runs on); a wait with
    a timeout would stall the host at every unit. gloo: the host waits anyway, with the timeout that names a unit a
    lonely rank waits for."""
    import datetime
    from megatron.zero.stage3 import wait_for_gather
    timeout = datetime.timedelta(seconds=3)
    nccl, gloo = _Handle(), _Handle()
    assert wait_for_gather(nccl, timeout, host_waits=False) and wait_for_gather(gloo, timeout, host_waits=True)
    assert nccl.waits == [((), {})]
    assert gloo.waits == [((), {"timeout": timeout})]


@pytest.mark.parametrize("backend,size,timed", [("nccl", 2, False), ("gloo", 2, True), ("gloo", 1, False)])
def test_a_stage3_buffer_times_its_waits_only_on_gloo(monkeypatch, backend, size, timed):
    """The buffer's own choice under a (mocked) NCCL data-parallel group: its gathers' waits are plain waits (the
    host runs on); on gloo at dp > 1 they take the timeout; at dp 1 there is nothing to wait for."""
    import datetime
    import types
    from megatron.zero import stage3
    monkeypatch.setattr(stage3.dist, "get_backend", lambda group=None: backend)
    ctx = types.SimpleNamespace(data_parallel_size=size, data_parallel_group=object())
    buffer = stage3._Buffer("unit", [], [], ctx, torch.device("cpu"))
    handle, timeout = _Handle(), datetime.timedelta(seconds=3)
    buffer.handles = [handle]
    buffer.finish_gather(timeout, "unit")
    assert handle.waits == [((), {"timeout": timeout} if timed else {})]
    assert buffer.state == "ready" and buffer.handles == []
