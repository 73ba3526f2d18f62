"""Checkpoints under expert parallelism (megatron/zero/expert_checkpoint.py): saved at EP 2 (data-parallel 2, ZeRO-1),
resumed at EP 2 on 4 ranks (data-parallel 4: each expert's optimizer state re-partitioned over an
expert-data-parallel group of 2) at ZeRO-2, the run continues as the uninterrupted one (losses and every parameter
within 1e-6); the weights (every expert) load at EP 1; the optimizer state at EP 1 is refused by name. Dropless,
no aux loss: the global batch split into 2 or 4 micro-batches trains the same model."""
import pytest
import torch
import torch.distributed as dist

from megatron.spawn import run_distributed
from tests.helpers import gathered_model_parallel, max_relative_difference

GLOBAL, SEQ, VOCAB, LR, SAVE_AT, STEPS = 4, 8, 32, 2e-3, 3, 5


def _model():
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(11)
    torch.manual_seed(11)
    return GPT2Model(GPT2ModelConfig(num_layers=2, vocab_size=VOCAB, hidden_size=16, num_attention_heads=2,
                                     max_sequence_length=SEQ, ffn_hidden_size=16, add_bias_linear=False,
                                     moe=mpu.MoEConfig(num_experts=4, topk=2), init_method_std=0.2))


def _every_parameter(engine, ctx):
    """{name: whole parameter} including the experts other expert-parallel ranks hold."""
    state = gathered_model_parallel(engine.module)
    if ctx.expert_model_parallel_size > 1:
        every = [None] * ctx.expert_model_parallel_size
        dist.all_gather_object(every, {k: v for k, v in state.items() if ".experts." in k},
                               group=ctx.expert_model_parallel_group)
        for experts in every:
            state.update(experts)
    return state


def _run(ep, stage, first, last, save_dir=None, load_dir=None, load_optimizer=True):
    """Steps first..last-1 (after loading `load_dir`); saves after step SAVE_AT - 1 into `save_dir`. Returns
    (losses, every parameter at the save or None, every parameter at the end)."""
    import mpu
    from megatron import zero
    from megatron.training import param_groups_for_weight_decay
    if ep > 1:
        mpu.initialize_expert_parallel(ep)
    model = _model()
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=LR, weight_decay=0.01)
    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    config = {"train_micro_batch_size_per_gpu": GLOBAL // dp, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                      dist_init_required=False)
    if load_dir is not None:
        engine.load_checkpoint(load_dir, load_optimizer_states=load_optimizer)
    losses, saved = [], None
    for step in range(first, last):
        tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * GLOBAL // dp:(rank + 1) * GLOBAL // dp]
        loss = engine(mine[:, :-1], labels=mine[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
        if save_dir is not None and step == SAVE_AT - 1:
            engine.save_checkpoint(save_dir, tag="moe")
            saved = _every_parameter(engine, engine.ctx)
    return losses, saved, _every_parameter(engine, engine.ctx)


def test_save_at_ep2_resume_at_ep2_on_4_ranks_and_weights_at_ep1(tmp_path):
    directory = str(tmp_path / "ckpt")
    losses, saved, final = run_distributed(_run, 2, args=(2, 1, 0, STEPS, directory), model_parallel_size=1)[0]
    assert len(saved) == len(final) and sum(".experts." in name for name in saved) == 2 * 4 * 2
    resumed = run_distributed(_run, 4, args=(2, 2, SAVE_AT, STEPS, None, directory), model_parallel_size=1)
    for resumed_losses, _, resumed_final in resumed:
        assert max_relative_difference(resumed_losses, losses[SAVE_AT:]) <= 1e-6, (resumed_losses, losses)
        assert resumed_final.keys() == final.keys()
        assert max_relative_difference(resumed_final, {name: final[name] for name in resumed_final}) <= 1e-6
    weights_only = run_distributed(_run, 2, args=(1, 1, 0, 0, None, directory, False), model_parallel_size=1)[0]
    assert all(torch.equal(weights_only[2][name], saved[name]) for name in saved)
    with pytest.raises(RuntimeError, match="saved at expert-model-parallel size 2, this run uses 1"):
        run_distributed(_run, 2, args=(1, 1, 0, 0, None, directory), model_parallel_size=1)
