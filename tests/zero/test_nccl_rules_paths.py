"""The NCCL rules on the "meta" device (tests/zero/test_nccl_rules.py's fixture: mpu's device answers "meta", rank 0
of 2 on torch's fake process group) beyond the engine's matrix: sequence parallelism at tensor parallel 2 through
the ZeRO engine, generation (static cache and growing cache) at tensor parallel 2, a DPO step (the frozen reference
and the policy through the engine), the pipeline's first stage at pipeline parallel 2, context parallel 2 (ring
attention's exchanges) and Muon at ZeRO stages 1-3. Each runs a client model built on the CPU where a client would,
and every collective it reaches must hold device tensors only: a host tensor (a mask, a position table, a metric
left on the CPU, a receive or gather buffer allocated without the device) is refused by name. Expert parallelism
runs on gloo instead (MoE's dispatch reads its split sizes, which "meta" does not carry): EP 2 with offload."""
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
    from megatron.training import param_groups_for_weight_decay    # experts in groups of their own (MoE)
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=1e-3)
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
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.pipeline import p2p_communication, schedules
    exchanged = _fake_p2p(monkeypatch)
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


def _fake_p2p(monkeypatch):
    """The fake process group has no point-to-point on "meta": batch_isend_irecv, still checked by the rules,
    records the ops and completes them."""
    import torch.distributed as dist
    exchanged = []
    monkeypatch.setattr(dist, "batch_isend_irecv", nccl_rules._checking(
        "batch_isend_irecv", lambda ops: exchanged.extend(ops) or [_Done() for _ in ops]))
    return exchanged


def test_context_parallel_training_reaches_collectives_with_device_tensors_only(meta_everywhere, monkeypatch):
    """Context parallel 2 through the ZeRO engine: ring attention's exchanges (forward and backward), the engine's
    gradient reduction over the data x context group, the loss."""
    exchanged = _fake_p2p(monkeypatch)
    mpu.initialize_model_parallel(1, context_parallel_size=2)
    mpu.model_parallel_cuda_manual_seed(1)
    try:
        engine = _engine(_gpt())
        before = nccl_rules.checked
        loss = engine(_tokens(length=8), labels=_tokens(length=8)).mean()
        engine.backward(loss)
        engine.step()
    finally:
        mpu.destroy_model_parallel()
    assert {op.tensor.device for op in exchanged} == {META} and len(exchanged) > 0
    assert nccl_rules.checked > before


EP_ROWS = [(2, False), (2, True), (3, True)]      # (ZeRO stage, offload_optimizer)


def _expert_parallel_rows():
    """dp 2 = EP 2 on gloo under the rules (real values: MoE's dispatch reads its split sizes, which "meta" does not
    carry), 4 experts top-2: 2 steps of each EP_ROWS row; (rules on, collectives checked, {row: losses})."""
    from megatron.training import param_groups_for_weight_decay
    mpu.initialize_expert_parallel(2)
    losses = {}
    for stage, offload in EP_ROWS:
        mpu.model_parallel_cuda_manual_seed(1)
        model = _gpt(moe=mpu.MoEConfig(num_experts=4, topk=2))
        zero_options = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        engine = zero.initialize(model=model, config=dict(CONFIG, zero_optimization=zero_options), mpu=mpu,
                                 optimizer=torch.optim.AdamW(param_groups_for_weight_decay(model), lr=1e-2),
                                 dist_init_required=False)[0]
        tokens = torch.arange(32).view(2, 16) % GPT["vocab_size"]
        losses[stage, offload] = []
        for _ in range(2):
            loss = engine(tokens, labels=tokens.roll(-1, 1)).mean()
            engine.backward(loss)
            engine.step()
            losses[stage, offload].append(loss.item())
    return nccl_rules.requested(), nccl_rules.checked, losses


def test_expert_parallel_training_runs_under_the_rules_with_offload():
    """The experts' all-to-alls and their gradients' reduction over the expert-data-parallel group never take
    host offload memory (rule 2) at stages 2 and 3; the losses are the run without offload's."""
    from megatron.spawn import run_distributed
    for rules_on, checked, losses in run_distributed(_expert_parallel_rows, 2, model_parallel_size=1):
        assert rules_on and checked > 0
        for row in EP_ROWS[1:]:
            assert losses[row] == pytest.approx(losses[EP_ROWS[0]], rel=1e-6), row


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_steps_reach_collectives_with_device_tensors_only(meta_everywhere, stage):
    """Muon (DeepSpeed's {"type": "Muon"}; no offload: refused with it) at dp 2: the exchange of its Nesterov
    updates and the Adam half's collectives."""
    mpu.initialize_model_parallel(1)
    mpu.model_parallel_cuda_manual_seed(1)
    config = dict(CONFIG, optimizer={"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3}},
                  zero_optimization={"stage": stage})
    try:
        model = _gpt()
        engine = zero.initialize(model=model, config=config, mpu=mpu, dist_init_required=False)[0]
        before = nccl_rules.checked
        for _ in range(2):
            loss = engine(_tokens(), labels=_tokens()).mean()
            engine.backward(loss)
            engine.step()
    finally:
        mpu.destroy_model_parallel()
    assert {p.device for p in engine.module.parameters()} == {META}
    assert nccl_rules.checked > before
