"""Generation with a mixture-of-experts model (mpu/moe.py through generate): at expert-parallel size 2 (two
data-parallel ranks, each with its own prompts) every rank's tokens equal the same model's generation at EP 1 in
one process on that rank's prompts, token for token: greedy and sampled, static and growing KV cache, left-padded
batches of unequal lengths, rows that end at different steps (the position table, an end-of-document id), a rank
with no prompt at all. Every forward's dispatch is an all-to-all over the expert group, so both ranks must run the
same number of forward steps although rank 0's rows end after 14 tokens and rank 1's after 24: they are counted,
and a rank that stops early hangs its peer (the launch's timeout fails the test instead of waiting forever)."""
import torch

from megatron.spawn import run_distributed
from tests.inference.test_generation import build_model

_ids = torch.randint(1, 64, (64,), generator=torch.Generator().manual_seed(7)).tolist()
RANK_PROMPTS = [[_ids[:30], _ids[30:56]],                           # 30 and 26 tokens: 10 and 14 new (of 40)
                [_ids[56:59], _ids[59:63], _ids[63:]]]               # 3, 4 and 1 tokens: 24 new each
NEW, POSITIONS = 24, 40      # rank 0 is done after 14 steps, before generate's first done-check at step 16
MODES = {"greedy static": dict(greedy=True), "greedy growing": dict(greedy=True, static_cache=False),
         "sampled static": dict(greedy=False, temperature=0.8, top_k=30, seed=11),
         "sampled growing": dict(greedy=False, temperature=0.8, top_k=30, seed=11, static_cache=False)}


def _moe_model():
    import mpu
    return build_model(max_sequence_length=POSITIONS, moe=mpu.MoEConfig(num_experts=4, topk=2))


def _generate_counted(model, prompts, **options):
    """(generate's tokens, the number of forward calls it made)."""
    from megatron.text_generation import generate
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        return generate(model, prompts, NEW, **options), len(calls)
    finally:
        handle.remove()


def _ep_1_then_ep_2():
    """On each rank: per mode, (EP 1 tokens: the whole model in this process, before the expert groups exist, on
    this rank's prompts; EP 2 tokens; EP 2 forward calls). The end-of-document id ends rank 1's first row at its
    second token (greedy)."""
    import torch.distributed as dist

    import mpu
    from megatron.text_generation.generation import lockstep_group
    rank = dist.get_rank()
    prompts = RANK_PROMPTS[rank]
    whole = _moe_model()
    eod = _generate_counted(whole, RANK_PROMPTS[1], greedy=True)[0][0][1]
    modes = dict(MODES, eod=dict(greedy=True, eod_id=eod))
    reference = {mode: _generate_counted(whole, prompts, **options)[0] for mode, options in modes.items()}
    reference["one rank without prompts"] = reference["greedy static"] if rank else []
    mpu.initialize_expert_parallel(2)
    model = _moe_model()
    result = {mode: (reference[mode],) + _generate_counted(model, prompts, **options)
              for mode, options in modes.items()}
    result["one rank without prompts"] = (reference["one rank without prompts"],) + _generate_counted(
        model, prompts if rank else [], greedy=True)
    experts = sorted({name.split(".experts.")[1].split(".")[0] for name, _ in model.named_parameters()
                      if ".experts." in name})
    return result, eod, experts, dist.get_process_group_ranks(lockstep_group(model))


def test_moe_generation_at_ep_2_equals_ep_1_with_every_rank_in_step():
    results = run_distributed(_ep_1_then_ep_2, 2, model_parallel_size=1, timeout=150)
    for rank, (result, eod, experts, group) in enumerate(results):
        assert experts == (["0", "1"] if rank == 0 else ["2", "3"]) and group == [0, 1]
        for mode, (reference, tokens, _) in result.items():
            assert tokens == reference, (mode, rank)
    first, second = results[0][0], results[1][0]
    assert [len(row) for row in first["greedy static"][0]] == [10, 14]         # the position table ends them
    assert [len(row) for row in second["greedy static"][0]] == [NEW] * 3
    assert len(second["eod"][0][0]) == 2 and second["eod"][0][0][-1] == results[1][1]
    assert second["sampled static"][0] != second["greedy static"][0]
    assert first["one rank without prompts"][1] == []
    for mode in list(MODES) + ["one rank without prompts"]:    # the prompt, then one step per later token
        assert first[mode][2] == second[mode][2] == NEW, mode
    assert first["eod"][2] == second["eod"][2]
