"""Batched generation of prompts of different lengths (left-padded, one KV cache per call): each row's tokens are
those it gets alone and those of Hugging Face GPT2LMHeadModel.generate on the same weights; the cache is written
in place; the end of the position table caps a row; generation stops once every row has produced end-of-text.
One process runs every case (the module fixture); each test asserts one quantity."""
import pytest
import torch

from megatron.spawn import run_distributed
from tests.inference.test_generation import _hf_greedy, build_model

PROMPTS = [[5, 9, 3], [11, 60, 61, 7, 33, 2, 8], [40, 2, 17, 9, 13]]     # lengths 3, 7, 5
NEW = 12                                                                # 7 + 12 <= 24 positions
LONG, SHORT = list(range(1, 21)), [7, 8, 9]                             # 20 tokens: room for 4 of 24
FOUR = PROMPTS + [[3, 14, 15, 9, 26, 5]]        # 4 rows: the LM head decodes through oneDNN (1 row alone: not)


def _hf_batched_left_padded(model, prompts, new):
    """HF generate on the whole batch, left-padded with its attention mask (its own padding scheme)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tests.model.test_gpt2_model import copy_into_hf
    config = model.config
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=config.vocab_size, n_positions=config.max_sequence_length,
                                    n_embd=config.hidden_size, n_layer=config.num_layers,
                                    n_head=config.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=None, pad_token_id=0)).eval()
    copy_into_hf(model, hf)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                      eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def _padded_prefill_error(model):
    """Max |logit difference| between every real position of the left-padded batch and the prompt alone; whether
    every logit (padding positions included) is finite; whether every query of the mask sees some key."""
    from megatron.text_generation.generation import left_padded_layout
    lengths = [len(p) for p in PROMPTS]
    width = max(lengths)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    position_ids, mask = left_padded_layout(lengths, width, model.config.max_sequence_length, tokens.device)
    with torch.no_grad():
        logits = model(tokens, position_ids=position_ids, attention_mask=mask)                # [3, 7, V]
        error = max((logits[row, width - len(p):] - model(torch.tensor([p]))[0]).abs().max().item()
                    for row, p in enumerate(PROMPTS))
    return error, bool(torch.isfinite(logits).all()), bool((~mask).any(-1).all())


def _cache_writes(model):
    """(key buffer address, value buffer address, cached length, buffer shape) after every forward of one layer's
    attention during a batched generate call."""
    from megatron.text_generation import generate
    seen = []

    def record(module, args, output):
        past = args[2]
        seen.append((past.key_buffer.data_ptr(), past.value_buffer.data_ptr(), past.length,
                     tuple(past.key_buffer.shape), sorted(tuple(w.shape) for w in past.transposed.values())))
    handle = model.transformer.layers[1].attention.register_forward_hook(record)
    try:
        generate(model, PROMPTS, NEW, greedy=True)
    finally:
        handle.remove()
    return seen


def _head_layouts(model, prompts):
    """The kinds of decoding layout the cache holds at the second step of a generate call ("onednn": a packed
    weight, "transposed": a transposed copy), and the shape of each."""
    from megatron.text_generation import generate
    seen = []

    def record(module, args, output):
        seen.append(sorted(("onednn" if isinstance(key, tuple) else "transposed", tuple(w.shape))
                           for key, w in args[2].transposed.items()))
    handle = model.transformer.layers[0].attention.register_forward_hook(record)
    try:
        generate(model, prompts, 3, greedy=True)
    finally:
        handle.remove()
    return seen[1]


def _early_stop():
    """One prompt whose first greedy token is end-of-text, 40 new tokens allowed: (output, model forwards)."""
    from megatron.text_generation import generate
    model = build_model(max_sequence_length=64)
    eod = generate(model, [PROMPTS[0]], 1, greedy=True)[0][0]
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    out = generate(model, [PROMPTS[0]], 40, greedy=True, eod_id=eod)
    handle.remove()
    return out, len(calls), eod


def _all_cases():
    from megatron.text_generation import generate
    model = build_model()
    result = {"batched": generate(model, PROMPTS, NEW, greedy=True),
              "recompute": generate(model, PROMPTS, NEW, greedy=True, use_cache=False),
              "alone": [generate(model, [p], NEW, greedy=True)[0] for p in PROMPTS],
              "hf_alone": _hf_greedy(model, PROMPTS, NEW),
              "hf_batched": _hf_batched_left_padded(model, PROMPTS, NEW),
              "capped": generate(model, [LONG, SHORT], NEW, greedy=True),
              "capped_recompute": generate(model, [LONG, SHORT], NEW, greedy=True, use_cache=False),
              "capped_hf": [_hf_greedy(model, [LONG], 4)[0], _hf_greedy(model, [SHORT], NEW)[0]],
              "prefill": _padded_prefill_error(model),
              "writes": _cache_writes(model),
              "early_stop": _early_stop(),
              "four": generate(model, FOUR, NEW, greedy=True),
              "four_alone": [generate(model, [p], NEW, greedy=True)[0] for p in FOUR],
              "four_hf": _hf_batched_left_padded(model, FOUR, NEW),
              "layouts": {rows: _head_layouts(model, FOUR[:rows]) for rows in (3, 4)}}
    return result


@pytest.fixture(scope="module")
def cases():
    return run_distributed(_all_cases, 1, model_parallel_size=1)[0]


def test_batched_prompts_of_lengths_3_7_5_give_each_prompt_alone_and_huggingface(cases):
    assert all(len(row) == NEW for row in cases["hf_alone"])
    assert cases["batched"] == cases["alone"] == cases["hf_alone"] == cases["hf_batched"]


def test_kv_cache_equals_recompute_on_padded_batches(cases):
    assert cases["batched"] == cases["recompute"] == cases["hf_alone"]
    assert cases["capped"] == cases["capped_recompute"]


def test_left_padded_prefill_has_each_prompt_alone_logits(cases):
    error, finite, no_empty_row = cases["prefill"]
    # A padding query sees itself: an all-masked row is NaN in some SDPA kernels (0 in torch 2.13's CPU one).
    assert finite and no_empty_row
    assert error <= 1e-5


def test_the_position_table_caps_each_row_on_its_own(cases):
    # 24 positions: the 20-token prompt gets 4 new tokens, the 3-token one all 12, each as alone (HF).
    assert [len(row) for row in cases["capped"]] == [4, NEW]
    assert cases["capped"] == cases["capped_hf"]


def test_the_cache_is_allocated_once_and_written_in_place(cases):
    writes = cases["writes"]
    width = max(map(len, PROMPTS))
    assert len(writes) == NEW                                  # one prefill, then NEW - 1 one-token steps
    assert len({(key, value) for key, value, _, _, _ in writes}) == 1
    assert [length for _, _, length, _, _ in writes] == list(range(width, width + NEW))
    assert {shape for _, _, _, shape, _ in writes} == {(len(PROMPTS), 4, width + NEW, 8)}   # [b, heads, cols, d]
    # CPU decoding layouts, made at the first step and kept: every layer's q/k/v [h, 3h] and MLP-in [h, 4h]
    # transposed and the LM head [h, V]; never the out < in ones (attention out, MLP out). At layer 1's first
    # attention only layer 0's two and layer 1's q/k/v exist.
    h, layers, vocab = 32, 2, 64
    assert writes[0][4] == [(h, 3 * h)] * 2 + [(h, 4 * h)], writes[0][4]
    assert all(w[4] == sorted([(h, 3 * h)] * layers + [(h, 4 * h)] * layers + [(h, vocab)]) for w in writes[1:])


def test_decoding_layout_only_for_wide_cpu_weights_not_gathered_per_unit():
    from mpu.transformer import decoding_weight_t
    store, wide = {}, torch.randn(5, 4)
    assert torch.equal(decoding_weight_t(store, wide), wide.t()) and decoding_weight_t(store, wide).is_contiguous()
    assert decoding_weight_t(store, wide) is decoding_weight_t(store, wide)          # made once
    assert decoding_weight_t(store, torch.randn(4, 4)) is None and decoding_weight_t(store, torch.randn(4, 5)) is None
    per_unit = torch.nn.Parameter(torch.randn(6, 4))
    per_unit.ds_manager = type("Manager", (), {"hooks_bypassed": False})()        # ZeRO-3, gathered per unit
    assert decoding_weight_t({}, per_unit) is None
    per_unit.ds_manager.hooks_bypassed = True                                      # gathered_for_inference
    assert torch.equal(decoding_weight_t({}, per_unit), per_unit.detach().t())


def test_four_rows_decode_through_onednn_and_match_each_alone_and_huggingface(cases):
    """From ONEDNN_HEAD_MIN_ROWS = 4 rows the LM head multiplies by oneDNN's packed weight (a prompt alone: the
    transposed copy): the tokens are each prompt's alone and HF's."""
    h, layers, vocab = 32, 2, 64
    layer_layouts = [("transposed", (h, 3 * h))] * layers + [("transposed", (h, 4 * h))] * layers
    assert cases["layouts"][3] == sorted(layer_layouts + [("transposed", (h, vocab))]), cases["layouts"]
    assert [kind for kind, _ in cases["layouts"][4]].count("onednn") == 1, cases["layouts"]
    assert ("transposed", (h, vocab)) not in cases["layouts"][4]
    assert cases["four"] == cases["four_alone"] == cases["four_hf"]


def test_head_matmul_layouts_and_their_products():
    """decoding_head_matmul: 3 rows the transposed copy, 4 rows oneDNN (float32 CPU, no autograd), both equal to
    x @ W^T (1e-5); a bf16 weight or autograd on keeps the transposed copy; a ZeRO-3 weight gathered per unit
    gets none."""
    from mpu.transformer import decoding_head_matmul, ONEDNN_HEAD_MIN_ROWS
    assert ONEDNN_HEAD_MIN_ROWS == 4
    torch.manual_seed(0)
    weight = torch.randn(96, 16)
    with torch.no_grad():
        for rows, kind in ((3, int), (4, tuple)):
            store, x = {}, torch.randn(rows, 1, 16)
            out = decoding_head_matmul(store, weight, rows)(x)
            assert out.shape == (rows, 1, 96) and torch.allclose(out, x @ weight.t(), atol=1e-5, rtol=0)
            assert [type(key) for key in store] == [kind], store.keys()
        store = {}
        decoding_head_matmul(store, weight.bfloat16(), 8)
        assert [type(key) for key in store] == [int]
    store = {}                                                   # with autograd on: the transposed copy
    decoding_head_matmul(store, weight, 8)
    assert [type(key) for key in store] == [int]
    per_unit = torch.nn.Parameter(weight.clone())
    per_unit.ds_manager = type("Manager", (), {"hooks_bypassed": False})()        # ZeRO-3, gathered per unit
    assert decoding_head_matmul({}, per_unit, 8) is None and decoding_head_matmul({}, per_unit, 1) is None


def test_generation_stops_at_the_first_done_check_after_every_row_ended(cases):
    from megatron.text_generation.generation import DONE_CHECK_INTERVAL
    out, forwards, eod = cases["early_stop"]
    assert out == [[eod]]
    assert forwards == DONE_CHECK_INTERVAL < 40
