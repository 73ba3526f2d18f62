"""The MoE layer's dispatch reads the device from the host as little as its design allows (mpu/moe.py): one MoE
layer's forward and backward, counted at the dispatcher (`.item()`, `bool(t)`, ops whose output size depends on the
values such as nonzero, a boolean-mask index) and at Python (`Tensor.tolist`, `.numpy`: on the CPU they read memory
without an aten op). None at expert-parallel 1 on the grouped kernel, one (the split sizes) on the per-expert loop
and at expert-parallel 2; the old dispatch read 2 and 3. And the grouped kernel (mpu/grouped_experts.py) equals the
experts run one after another, output and every gradient, with an expert of no rows and rows past the kept.

Device-agnostic (tools/gpu_check.sh runs it with --device cuda): on CUDA in bf16, where the grouped kernel runs on
sm90+ (H100, H200), and a forward at expert-parallel 1 also runs under torch.cuda's sync debug mode "error"."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.spawn import run_distributed
from megatron.text_generation.capture import DATA_DEPENDENT_SHAPES, HOST_READS

_aten = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Counts what reads the device from the host inside it (by name, in order)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sized_by_values = func in DATA_DEPENDENT_SHAPES and kwargs.get("output_size") is None
        boolean_index = func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and \
            any(t is not None and t.dtype == torch.bool for t in args[1])
        if func in HOST_READS or sized_by_values or boolean_index:
            self.seen.append(str(func))
        return func(*args, **kwargs)


class HostCopies(TorchFunctionMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.reads.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _device_and_dtype():
    """The run's device and the dtype its grouped kernel takes (fp32 on the CPU, bf16 on CUDA)."""
    import mpu
    device = mpu.get_device()
    return device, torch.float32 if device.type == "cpu" else torch.bfloat16


def _host_reads(ep, hidden, capacity_factor):
    """(host reads of one forward, of its backward) of an MoE layer at expert-parallel `ep`."""
    import mpu
    mpu.initialize_expert_parallel(ep)
    device, dtype = _device_and_dtype()
    config = mpu.MoEConfig(num_experts=4, topk=2, capacity_factor=capacity_factor, aux_loss_coeff=0.1)
    torch.manual_seed(0)
    layer = mpu.MoEMLP(hidden, 16, config, mpu.init_method_normal(0.5), mpu.init_method_normal(0.5), swiglu=True)
    layer.to(dtype)
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    x = x.to(device, dtype).requires_grad_(True)
    if device.type == "cuda" and ep == 1 and hidden % 8 == 0:     # the grouped kernel: no sync at all
        torch.cuda.set_sync_debug_mode("error")
        layer(x)
        torch.cuda.set_sync_debug_mode("default")
    counts = []
    for step in ("forward", "backward"):
        reads = HostReads()
        with reads, HostCopies(reads):
            if step == "forward":
                out = layer(x)
            else:
                out.square().sum().backward()
        counts.append(reads.seen)
    return counts


@pytest.mark.parametrize("ep, hidden, capacity_factor, expected", [
    (1, 8, None, 0),      # the grouped kernel: offsets on the device
    (1, 8, 0.75, 0),      # a capacity that drops: the dropped rows run in the last group, masked
    (1, 6, 0.75, 1),      # 6 fp32 (bf16 on CUDA) = 24 (12) bytes a row, not whole 16 bytes: the loop reads the sizes
    (2, 8, 0.75, 1),      # the all-to-all's split sizes (this rank's and the received, one read)
])
def test_one_moe_layer_reads_the_host_at_most_once(ep, hidden, capacity_factor, expected):
    for forward, backward in run_distributed(_host_reads, ep, args=(ep, hidden, capacity_factor),
                                             model_parallel_size=1, timeout=120):
        assert len(forward) == expected and forward.count("tolist") == expected, forward
        assert backward == [], backward


def _grouped_and_loop(swiglu, bias, dtype):
    """(grouped outputs and gradients, loop outputs and gradients) of 3 experts on 11 rows: 4 | 0 | 5, then 2 rows
    past the kept that run in the last group (as at EP 1 with drops) and are discarded."""
    import mpu
    from mpu.grouped_experts import grouped_forward, grouped_supported
    from mpu.moe import Expert
    device = _device_and_dtype()[0]
    dtype = torch.bfloat16 if device.type == "cuda" else dtype
    torch.manual_seed(0)
    experts = [Expert(8, 16, swiglu, bias, mpu.init_method_normal(0.5), mpu.init_method_normal(0.5))
               for _ in range(3)]
    for expert in experts:
        expert.to(dtype)
        if bias:
            with torch.no_grad():
                for linear in (expert.dense_h_to_4h, expert.dense_4h_to_h):
                    linear.bias.normal_(0, 0.3)
    assert grouped_supported(experts, dtype, device)
    rows = torch.randn(11, 8, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    probe = torch.randn(9, 8, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    sizes, expert_of_row = [4, 0, 5], torch.tensor([0] * 4 + [2] * 5 + [1, 0], device=device)
    results = []
    for grouped in (True, False):
        for expert in experts:
            expert.zero_grad()
        x = rows.clone().requires_grad_(True)
        if grouped:
            ends = torch.tensor([4, 4, 11], dtype=torch.int32, device=device)
            out = grouped_forward(experts, x, ends, expert_of_row)[:9]
        else:
            out = torch.cat([e(piece) for e, piece in zip(experts, x[:9].split(sizes))])
        (out * probe).sum().backward()
        grads = [x.grad] + [p.grad for e in experts for p in e.parameters()]
        results.append([t.cpu() for t in [out.detach()] + grads])
    return results, dtype


@pytest.mark.parametrize("swiglu, bias, dtype", [(True, False, torch.float32), (False, True, torch.float32),
                                                (True, True, torch.bfloat16)])    # CUDA: bf16 for all three
def test_grouped_experts_equal_the_experts_one_after_another(swiglu, bias, dtype):
    (grouped, loop), ran = run_distributed(_grouped_and_loop, 1, args=(swiglu, bias, dtype), model_parallel_size=1)[0]
    tolerance = 1e-6 if ran == torch.float32 else 1e-2
    for index, (ours, theirs) in enumerate(zip(grouped, loop)):
        assert torch.isfinite(ours).all(), index
        scale = max(1.0, float(theirs.abs().max()))
        assert float((ours.float() - theirs.float()).abs().max()) <= tolerance * scale, index
