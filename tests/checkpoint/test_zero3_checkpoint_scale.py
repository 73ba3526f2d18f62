"""ZeRO-3 checkpoints at scale (issue 24 item 4): the host memory a rank uses to save or load a stage-3 checkpoint,
counted as the bytes of the tensors it materialises (every new host storage an op creates, and every storage
torch.load reads into memory; a memory-mapped load's tensors stay in the file until a slice is copied).

Bound: this rank's share of the checkpoint (its slice of the 16-bit module, its optimizer partition: fp32 master
and both Adam moments) plus one largest tensor.
- load at dp 2: within the bound (the model-states file is memory-mapped; each rank copies only its pieces)
The save side is not bounded yet (issue 24 item 4 remains open): data-parallel rank 0 still gathers the whole 16-bit
module into host memory whatever stage3_gather_16bit_weights_on_model_save says (measured at dp 2: 26,034 bytes
against a bound of 19,520 on rank 0; rank 1 18,724).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.spawn import run_distributed
from tests.zero.test_zero3 import SAVE_AT, _ckpt_engine, _steps


class CountMaterialised(TorchDispatchMode):
    """Bytes of the host storages created while active: by any op (outputs not sharing an input's storage) and by
    torch.load without mmap (its tensors' storages are read into memory)."""

    def __init__(self):
        super().__init__()
        self.bytes, self._seen = 0, set()

    def _count(self, tensors, inputs=()):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage._cdata not in self._seen:
                    self._seen.add(storage._cdata)
                    self.bytes += storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self._count(tree_flatten(out)[0], inputs)
        return out

    def __enter__(self):
        self._load = torch.load

        def counted_load(*args, **kwargs):
            result = self._load(*args, **kwargs)
            if not kwargs.get("mmap"):
                self._count(tree_flatten(result)[0])
            return result
        torch.load = counted_load
        return super().__enter__()

    def __exit__(self, *exc):
        torch.load = self._load
        return super().__exit__(*exc)


def _share_and_largest(engine):
    """(bytes of this rank's share of the checkpoint, bytes of the largest tensor in it)."""
    dp = engine.ctx.data_parallel_size
    module = sum(g.numel * g.dtype.itemsize for g in engine.stage3.groups) // dp
    optimizer = sum(g.numel * 4 * 3 for g in engine.optimizer.groups) // dp        # master, exp_avg, exp_avg_sq
    from mpu import full_numel
    largest = max(full_numel(p) * 4 for p in engine.module.parameters())
    return module + optimizer, largest


def _save_and_load(save_dir):
    engine = _ckpt_engine(3)
    _steps(engine, 0, SAVE_AT)
    with CountMaterialised() as saving:
        engine.save_checkpoint(save_dir, tag="a")
    fresh = _ckpt_engine(3)
    with CountMaterialised() as loading:
        fresh.load_checkpoint(save_dir, tag="a")
    assert all(torch.equal(a, b) for a, b in zip(engine.optimizer.masters, fresh.optimizer.masters))
    share, largest = _share_and_largest(engine)
    return {"save": saving.bytes, "load": loading.bytes, "share": share, "largest": largest}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_distributed(_save_and_load, 2, args=(str(tmp_path_factory.mktemp("zero3") / "save"),))


def test_stage3_load_materialises_at_most_its_share_plus_one_tensor(measured):
    for rank, m in enumerate(measured):
        assert m["load"] <= m["share"] + m["largest"], (rank, m)
