"""The NCCL rules on the "meta" device (tests/zero/test_nccl_rules.py's fixture: mpu's device answers "meta", rank 0
of 2 on torch's fake process group) beyond the engine's matrix: sequence parallelism at tensor parallel 2 through
the ZeRO engine, generation (static cache and growing cache) at tensor parallel 2, a DPO step (the frozen reference
and the policy through the engine), and the pipeline's first stage at pipeline parallel 2. Each runs a client model
built on the CPU where a client would, and every collective it reaches must hold device tensors only: a host tensor
(a mask, a position table, a metric left on the CPU) is refused by name."""
from unittest import mock

import pytest
import torch

import mpu
from megatron import zero
from megatron.guards import nccl_rules
from tests.zero.test_nccl_rules import META, meta_rank  # noqa: F401  (the fixture)

GPT = dict(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4, max_sequence_length=16)
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 2, "contiguous_gradients": True,
                                                            "overlap_comm": True}}


@pytest.fixture
def meta_everywhere(meta_rank, monkeypatch):  # noqa: F811
    """Every module that bound mpu's get_device by name (`from mpu.utils import get_device`) answers "meta" too."""
    import sys
    original = mpu.utils.get_device.__wrapped__ if hasattr(mpu.utils.get_device, "__wrapped__") else None
    for name, module in list(sys.modules.items()):
        if (name.startswith(("mpu", "megatron")) and getattr(module, "get_device", None) is not None
                and getattr(module.get_device, "__module__", "") == "mpu.utils" and module is not mpu.utils):
            monkeypatch.setattr(module, "get_device", lambda: META)
    del original


@pytest.fixture
def model_parallel_2(meta_everywhere):
    mpu.initialize_model_parallel(2)
    mpu.model_parallel_cuda_manual_seed(1)
    try:
        yield
    finally:
        mpu.destroy_model_parallel()


def _gpt(**overrides):
    from megatron.model import GPT2Model, GPT2ModelConfig
    return GPT2Model(GPT2ModelConfig(**dict(GPT, **overrides)), parallel_output=True)


def _engine(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return zero.initialize(model=model, optimizer=optimizer, config=dict(CONFIG), mpu=mpu,
                           dist_init_required=False)[0]


def _tokens(rows=2, length=16):
    return torch.zeros(rows, length, dtype=torch.long, device=META)


def test_sequence_parallel_training_reaches_collectives_with_device_tensors_only(model_parallel_2):
    before = nccl_rules.checked
    engine = _engine(_gpt(sequence_parallel=True))
    for _ in range(2):
        loss = engine(_tokens(), labels=_tokens()).mean()
        engine.backward(loss)
        engine.step()
    assert {p.device for p in engine.module.parameters()} == {META}
    assert nccl_rules.checked > before


@pytest.mark.parametrize("static_cache", [True, False])
def test_generation_at_tensor_parallel_2_reaches_collectives_with_device_tensors_only(model_parallel_2,
                                                                                      static_cache):
    from megatron.text_generation import generate
    model = _gpt().to(META)      # as load_inference_model places it
    before = nccl_rules.checked
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, greedy=True, static_cache=static_cache,
                   cuda_graph=False)
    assert len(out) == 2
    assert nccl_rules.checked > before


def test_a_dpo_step_reaches_collectives_with_device_tensors_only(meta_everywhere):
    """At data parallel 2 (tensor parallel 1: broadcast_data's shapes are values, which "meta" does not carry)."""
    from megatron.posttrain.dpo import Reference, dpo_forward_step
    mpu.initialize_model_parallel(1)
    mpu.model_parallel_cuda_manual_seed(1)
    rows = {"text": torch.ones(2, 2, 9, dtype=torch.long), "loss_mask": torch.ones(2, 2, 9, dtype=torch.long),
            "segments": torch.ones(2, 2, 9, dtype=torch.long)}      # host rows, as the loader gives them
    engine = _engine(_gpt())
    before = nccl_rules.checked
    try:
        loss, reported = dpo_forward_step(Reference(), 0.1, iter([rows]), engine)
        engine.backward(loss)
        engine.step()
    finally:
        mpu.destroy_model_parallel()
    assert reported["lm loss"][0].device == META
    assert nccl_rules.checked > before


class _Done:
    def wait(self):
        return True


def test_the_first_pipeline_stage_reaches_collectives_with_device_tensors_only(meta_everywhere, monkeypatch):
    """Rank 0 of a 2-stage pipeline (GPT-2's embedding and layers) runs 1F1B over 4 micro-batches: its sends of
    activations and receives of their gradients hold device tensors only (checked by the rules; the fake process
    group has no point-to-point on "meta", so the exchange itself is a no-op here)."""
    import torch.distributed as dist
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.pipeline import p2p_communication, schedules
    exchanged = []
    monkeypatch.setattr(dist, "batch_isend_irecv", nccl_rules._checking(
        "batch_isend_irecv", lambda ops: exchanged.extend(ops) or [_Done() for _ in ops]))
    mpu.initialize_model_parallel(1, 2)
    mpu.model_parallel_cuda_manual_seed(1)
    try:
        assert mpu.is_pipeline_first_stage() and not mpu.is_pipeline_last_stage()
        model = GPT2Model(GPT2ModelConfig(**GPT), parallel_output=True)     # the first stage's part
        model.to(META)
        batches = iter([_tokens() for _ in range(4)])

        def forward_step(iterator, module):
            return module(next(iterator), labels=_tokens()), {}

        def backward(output, output_grad, index, after_backward):
            torch.autograd.backward(output, output_grad)
            after_backward()
        before = nccl_rules.checked
        shape = model(_tokens(), labels=_tokens()).shape
        spec = p2p_communication.TensorSpec(tuple(shape), torch.float32, META)
        schedules.get_forward_backward_func()(forward_step, batches, model, backward, 4, spec)
        assert nccl_rules.checked > before and len(exchanged) == 8     # 4 activations sent, 4 gradients received
    finally:
        mpu.destroy_model_parallel()
