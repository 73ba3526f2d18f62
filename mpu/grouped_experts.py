"""An MoE layer's local experts in one grouped matmul per linear (torch._grouped_mm), not one expert after another.

Rows sorted expert-major, `offsets` [E/EP] the cumulative row counts (a device tensor: nothing is read on the host),
so expert j's rows are [offsets[j-1], offsets[j]). Each linear multiplies every group of rows by its expert's
weight in one call. The last offset must be the number of rows: the kernel leaves rows after it undefined in the
output and in the input's gradient. A bias is added as one_hot(expert of the row) @ the stacked biases: exact, and
its gradient a matmul (a gather's backward would add rows into one place with atomics on CUDA).

    dense_h_to_4h:  copy_to_model_parallel_region, [n, h] x [E/EP, h, f/p] -> [n, f/p], + the row's expert's bias
    dense_4h_to_h:  [n, f/p] x [E/EP, f/p, h] -> [n, h], reduce_from_model_parallel_region, + the bias

the same arithmetic as Expert.forward (mpu/moe.py) row by row. Where the kernel exists (the CPU; CUDA in bf16 on
sm90+), for strides of whole 16 bytes, and for experts without a LoRA adapter; otherwise grouped_supported() says
no and the layer runs its experts one after another.
"""
import torch
import torch.nn.functional as F

from .mappings import copy_to_model_parallel_region, reduce_from_model_parallel_region

ALIGNMENT_BYTES = 16     # the kernel's requirement on every stride


def grouped_supported(experts, dtype, device):
    """Whether the local `experts` (a list of mpu.moe.Expert) can run grouped on `device` in `dtype`."""
    if not hasattr(torch, "_grouped_mm") or not experts:
        return False
    if device.type == "cuda":
        if dtype not in (torch.bfloat16,) or torch.cuda.get_device_capability(device) < (9, 0):
            return False
    elif device.type != "cpu":
        return False
    linears = [linear for expert in experts for linear in (expert.dense_h_to_4h, expert.dense_4h_to_h)]
    if any(linear.lora_A is not None or linear.weight.dtype != dtype for linear in linears):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(dim * size % ALIGNMENT_BYTES == 0 for dim in linears[0].weight.shape + linears[1].weight.shape)


def grouped_forward(experts, rows, offsets, expert_of_row):
    """rows [n, h] expert-major, offsets [E/EP] int32 (cumulative counts), expert_of_row [n] (local expert of each
    row; any for a row whose output the caller discards) -> [n, h], row i through expert expert_of_row[i]."""
    first, second = [expert.dense_h_to_4h for expert in experts], [expert.dense_4h_to_h for expert in experts]
    projected = torch._grouped_mm(copy_to_model_parallel_region(rows), _stacked_t(first), offs=offsets)  # [n, f/p]
    one_hot = None
    if first[0].bias is not None:     # [n, E/EP], by comparison (F.one_hot checks the range on the host)
        one_hot = (expert_of_row[:, None] == torch.arange(len(experts), device=rows.device)).to(rows.dtype)
    if one_hot is not None:
        projected = projected + one_hot @ torch.stack([linear.bias for linear in first])
    if experts[0].swiglu:
        gate, up = projected.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(projected, approximate="tanh")
    output = reduce_from_model_parallel_region(
        torch._grouped_mm(hidden, _stacked_t(second), offs=offsets))                      # [n, h]
    if one_hot is not None:
        output = output + one_hot @ torch.stack([linear.bias for linear in second])
    return output


def _stacked_t(linears):
    """[E/EP, in, out]: every linear's weight [out, in], transposed (a view: the kernel reads it as stored)."""
    return torch.stack([linear.weight for linear in linears]).transpose(1, 2)
