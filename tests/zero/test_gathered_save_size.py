"""A parameter read inside zero.GatheredParameters and kept has a storage of its own (issue 53 row 9).

DeepSpeed-Chat's save_zero_three_model (tests/fixtures/ds_chat/utils.py) gathers one parameter at a time and keeps
`v.data.cpu()`, which on the CPU is `v.data` itself. When that was a view of its unit's gathered buffer, torch.save
wrote the whole buffer for each parameter: a unit of four parameters was written four times. Here each unit is a
Linear(64, 64) and a LayerNorm(64) (4096 + 64 + 64 + 64 elements), so the old file was 4.0x the parameters' bytes
(at dp 1, where the parameters are views of their group's partition, it would be the whole partition each);
now it is within a small per-tensor margin of them (the zip's headers and 64-byte alignment, measured ~0.3 KiB per
tensor with torch 2.13).
"""
import copy
import os

import torch
from torch import nn

from megatron import zero

WIDTH, UNITS = 64, 2
MARGIN_PER_TENSOR = 1024       # bytes: zip record, pickle entry and alignment of one small tensor (measured ~300)


class Blocks(nn.Module):
    """UNITS units (ModuleList elements), each Linear(WIDTH, WIDTH) -> LayerNorm(WIDTH): four parameters a unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(UNITS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _save_like_ds_chat(module, path):
    """save_zero_three_model's ZeRO-3 branch at rank 0 (one GatheredParameters per parameter, `v.data.cpu()`)."""
    state = {}
    for name, v in module.named_parameters():
        with zero.GatheredParameters([v]):
            state[name] = v.data.cpu()
    torch.save(state, path)


def test_saving_inside_gathered_parameters_writes_only_each_parameters_bytes(tmp_path):
    model = Blocks()
    plain = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config, dist_init_required=False)
    # dp 1: resident (whole views of their group's partition, stage3.py), so a kept `v.data` without a copy of its own
    # would write the whole partition for each parameter
    assert all(p.ds_status == zero.ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    path = tmp_path / "pytorch_model.bin"
    _save_like_ds_chat(engine.module, path)

    # From the shapes alone: per unit WIDTH * WIDTH + 3 * WIDTH fp32 elements.
    parameter_bytes = UNITS * (WIDTH * WIDTH + 3 * WIDTH) * 4
    tensors = UNITS * 4
    size = os.path.getsize(path)
    assert parameter_bytes <= size <= parameter_bytes + tensors * MARGIN_PER_TENSOR, (size, parameter_bytes)

    saved = torch.load(path)
    assert list(saved) == [n for n, _ in plain.named_parameters()]
    for name, p in plain.named_parameters():
        assert torch.equal(saved[name], p.detach()), name
        assert saved[name].untyped_storage().nbytes() == p.numel() * 4, name
