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


def _reference():
    """EP 1, one process: each rank's prompts in turn, every mode; the end-of-document id that ends rank 1's
    first row at its second token (greedy)."""
    model = _moe_model()
    result = {(mode, rank): _generate_counted(model, prompts, **options)[0]
              for mode, options in MODES.items() for rank, prompts in enumerate(RANK_PROMPTS)}
    eod = result["greedy static", 1][0][1]
    for rank, prompts in enumerate(RANK_PROMPTS):
        result["eod", rank] = _generate_counted(model, prompts, greedy=True, eod_id=eod)[0]
    return result, eod


def _expert_parallel(eod):
    import torch.distributed as dist

    import mpu
    from megatron.text_generation.generation import lockstep_group
    mpu.initialize_expert_parallel(2)
    model = _moe_model()
    rank = dist.get_rank()
    prompts = RANK_PROMPTS[rank]
    result = {mode: _generate_counted(model, prompts, **options) for mode, options in MODES.items()}
    result["eod"] = _generate_counted(model, prompts, greedy=True, eod_id=eod)
    result["one rank without prompts"] = _generate_counted(model, prompts if rank else [], greedy=True)
    result["experts"] = sorted({name.split(".experts.")[1].split(".")[0] for name, _ in model.named_parameters()
                                if ".experts." in name})
    result["group"] = dist.get_process_group_ranks(lockstep_group(model))
    return result


def test_moe_generation_at_ep_2_equals_ep_1_with_every_rank_in_step():
    reference, eod = run_distributed(_reference, 1, model_parallel_size=1)[0]
    assert [len(row) for row in reference["greedy static", 0]] == [10, 14]      # the position table ends them
    assert [len(row) for row in reference["greedy static", 1]] == [NEW] * 3
    assert len(reference["eod", 1][0]) == 2 and reference["eod", 1][0][-1] == eod
    assert reference["sampled static", 1] != reference["greedy static", 1]
    results = run_distributed(_expert_parallel, 2, args=(eod,), model_parallel_size=1, timeout=150)
    for rank, result in enumerate(results):
        assert result["experts"] == (["0", "1"] if rank == 0 else ["2", "3"])       # each rank its half
        assert result["group"] == [0, 1]
        for mode in list(MODES) + ["eod"]:
            assert result[mode][0] == reference[mode, rank], (mode, rank)
        assert results[1]["one rank without prompts"][0] == reference["greedy static", 1]
    assert results[0]["one rank without prompts"][0] == []
    for mode in list(MODES) + ["one rank without prompts"]:    # the prompt, then one step per later token
        assert results[0][mode][1] == results[1][mode][1] == NEW, mode
    assert results[0]["eod"][1] == results[1]["eod"][1]
