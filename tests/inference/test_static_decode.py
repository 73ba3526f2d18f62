"""Static decoding (generation.DecodeStep): the one-token steps at fixed shapes over the whole preallocated cache,
under a mask, give token for token what the growing-cache path gives (greedy and seeded sampling, batch 1 and a
left-padded batch of 3, model-parallel 1 and 2) and what Hugging Face's generate gives; the steps read only
buffers made once per call, so a replay that takes no arguments (what a CUDA graph is) gives the same tokens.
The replays go through capture.strict_capture, a stand-in as strict as a graph (the step's ops recorded once and
re-executed with their Python scalars frozen; a host read refused): GPT-2, the Llama options, LoRA through it, MoE
eagerly (the capture generate picks on CUDA); repeated calls of one shape reuse the capture."""
import pytest
import torch

from megatron.spawn import run_distributed
from tests.inference.test_generation import _hf_greedy, build_model

PROMPTS = [[5, 9, 3, 17, 40, 2, 8], [11], [60, 61, 7, 33]]       # lengths 7, 1, 4: left padding 0, 6, 3
NEW = 14                                                         # 7 + 14 = 21 of 24 positions
SAMPLING = dict(greedy=False, temperature=0.9, top_k=20, seed=5)


def counting_strict_capture(recordings, outputs):
    """strict_capture (the CUDA graph's strict stand-in: the step's ops recorded once, then replayed, forward()
    never run again) that puts each Recording in `recordings` and each replay's output tensor in `outputs`."""
    from megatron.text_generation.capture import strict_capture

    def capture(forward):
        replay = strict_capture(forward, recordings=recordings)

        def counted():
            outputs.append(replay())
            return outputs[-1]
        return counted
    return capture


def capture_chosen_on_cuda(model, recordings, outputs=None):
    """What generate's default (cuda_graph=None) picks for `model` on CUDA at model-parallel size 1, with the
    strict stand-in in place of the CUDA graph: counting_strict_capture, or False (eager steps)."""
    from megatron.text_generation.capture import cuda_graph_capture, graph_capture_default
    chosen = graph_capture_default(torch.device("cuda"), model)
    assert chosen in (None, cuda_graph_capture)
    return False if chosen is None else counting_strict_capture(recordings, [] if outputs is None else outputs)


def _steps_seen(model, prompts, **kwargs):
    """generate's tokens and, per forward of layer 1's attention: (input shape, mask shape or None, the addresses
    of the key/value buffers, of the mask and of the slot tensor)."""
    from megatron.text_generation import generate
    seen = []

    def hook(module, args, output):
        hidden, mask, past = args[0], args[1], args[2]
        seen.append((tuple(hidden.shape), None if mask is None else tuple(mask.shape), past.key_buffer.data_ptr(),
                     past.value_buffer.data_ptr(), None if mask is None else mask.data_ptr(),
                     None if past.position is None else past.position.data_ptr()))
    handle = model.transformer.layers[1].attention.register_forward_hook(hook)
    try:
        return generate(model, prompts, NEW, **kwargs), seen
    finally:
        handle.remove()


def _cases(with_hf):
    import mpu
    from megatron.text_generation import generate
    from megatron.text_generation.capture import cuda_graph_capture, graph_capture_default
    model = build_model()
    result = {}
    for name, prompts in (("one", PROMPTS[:1]), ("three", PROMPTS)):
        for mode, sampling in (("greedy", dict(greedy=True)), ("sampled", SAMPLING)):
            result[name, mode] = {"static": generate(model, prompts, NEW, **sampling),
                                  "growing": generate(model, prompts, NEW, static_cache=False, **sampling)}
    recordings, replays = [], []
    result["replayed"] = generate(model, PROMPTS, NEW, greedy=True,
                                  cuda_graph=capture_chosen_on_cuda(model, recordings, replays))
    result["replay_outputs"] = len({id(output) for output in replays}), len(replays), len(recordings)
    result["steps"] = _steps_seen(model, PROMPTS, greedy=True)[1]
    result["defaults"] = (graph_capture_default(torch.device("cpu"), model),
                          graph_capture_default(torch.device("cuda"), model) is cuda_graph_capture,
                          mpu.get_model_parallel_world_size())
    if with_hf:
        result["hf"] = _hf_greedy(model, PROMPTS, NEW)
    return result


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_cases, 1, args=(True,), model_parallel_size=1)[0]


def test_static_decoding_equals_the_growing_cache_and_huggingface_at_mp_1_and_2(reference):
    assert all(len(row) == NEW for row in reference["hf"])
    assert reference["three", "greedy"]["static"] == reference["three", "greedy"]["growing"] == reference["hf"]
    assert reference["one", "greedy"]["static"] == reference["one", "greedy"]["growing"] == reference["hf"][:1]
    for name in ("one", "three"):    # the same draws from the same seed
        assert reference[name, "sampled"]["static"] == reference[name, "sampled"]["growing"]
    assert reference["three", "sampled"]["static"] != reference["three", "greedy"]["static"]
    for rank_result in run_distributed(_cases, 2, args=(False,), model_parallel_size=2):
        for key in (("one", "greedy"), ("three", "greedy"), ("one", "sampled"), ("three", "sampled")):
            assert rank_result[key] == reference[key], key
        assert rank_result["defaults"] == (None, False, 2)   # mp 2 on CUDA: eager static steps unless asked


def test_a_replay_without_arguments_gives_the_same_tokens(reference):
    result = reference
    assert result["replayed"] == result["three", "greedy"]["static"]
    distinct, replays, captures = result["replay_outputs"]
    assert (distinct, replays, captures) == (1, NEW - 1, 1)   # one capture; every one-token step a replay


def test_the_steps_read_the_same_buffers_at_fixed_shapes(reference):
    result = reference
    prefill, *steps = result["steps"]
    batch, width, total = len(PROMPTS), max(map(len, PROMPTS)), max(map(len, PROMPTS)) + NEW
    assert prefill[:2] == ((batch, width, 32), (batch, 1, width, width))
    assert len(steps) == NEW - 1
    assert {step[:2] for step in steps} == {((batch, 1, 32), (batch, 1, 1, total))}
    assert len({step[2:] for step in steps}) == 1 and None not in steps[0][2:]
    assert steps[0][2:4] == prefill[2:4]                  # the prompt's buffers, written in place after
    assert result["defaults"] == (None, True, 1)         # CPU: eager static steps; CUDA at mp 1: the graph


LLAMA = dict(rotary=True, learned_position_embeddings=False, swiglu=True, normalization="rmsnorm",
             add_bias_linear=False, num_key_value_heads=2, untie_embeddings_and_output_weights=True)


def _families():
    """Per family (Llama options with grouped-query attention, LoRA, MoE): the static steps through the capture
    generate picks on CUDA (the strict stand-in for the graph, or eager steps) and the growing cache, greedy and
    sampled; the captures made; what choosing printed. And MoE forced through the stand-in."""
    import contextlib
    import io

    import mpu
    from megatron.text_generation import generate
    from megatron.text_generation.capture import HostReadInCapture, strict_capture
    result = {}
    for family, overrides in (("llama", LLAMA), ("lora", dict(lora=mpu.LoRAConfig(rank=2, zero_init_b=False))),
                              ("moe", dict(moe=mpu.MoEConfig(num_experts=4, topk=2)))):
        model, recordings, said = build_model(**overrides), [], io.StringIO()
        with contextlib.redirect_stdout(said):
            capture = capture_chosen_on_cuda(model, recordings)
        for mode, sampling in (("greedy", dict(greedy=True)), ("sampled", SAMPLING)):
            result[family, mode] = (generate(model, PROMPTS, NEW, cuda_graph=capture, **sampling),
                                    generate(model, PROMPTS, NEW, static_cache=False, **sampling))
        result[family, "captures"], result[family, "said"] = len(recordings), said.getvalue()
    try:
        result["moe forced"] = generate(model, PROMPTS, NEW, greedy=True, cuda_graph=strict_capture)
    except HostReadInCapture as error:
        result["moe forced"] = str(error)
    return result


def test_every_family_decodes_through_the_strict_stand_in_or_eagerly_for_moe():
    result = run_distributed(_families, 1, model_parallel_size=1)[0]
    for family in ("llama", "lora", "moe"):
        for mode in ("greedy", "sampled"):
            static, growing = result[family, mode]
            assert static == growing and [len(row) for row in static] == [NEW] * 3, (family, mode)
        assert result[family, "greedy"][0] != result[family, "sampled"][0]
    assert (result["llama", "captures"], result["lora", "captures"]) == (1, 1)    # the 2nd call reuses it
    assert result["llama", "said"] == result["lora", "said"] == ""
    assert result["moe", "captures"] == 0                                       # eager steps, said once:
    assert result["moe", "said"] == ("generation: CUDA graphs off for this model: its MoEMLP layers read the host "
                                     "in forward (token counts per expert); the static decode steps run eagerly\n")
    # forced through the strict stand-in: at EP 1 on the grouped kernel the dispatch reads nothing on the host
    # (mpu/moe.py), so the recorded step replays the eager tokens (the old dispatch failed here at aten.nonzero);
    # still decoded eagerly by default: at EP > 1 and on the per-expert loop it reads the split sizes
    assert result["moe forced"] == result["moe", "greedy"][0], result["moe forced"]


def _repeated_calls():
    """(tokens equal the growing cache's, captures made) per generate call through one capture function: calls of
    one shape after another, then a weight changed in place."""
    from megatron.text_generation import generate
    model, recordings = build_model(), []
    capture = counting_strict_capture(recordings, [])
    calls = [(PROMPTS, NEW, dict(greedy=True)), (PROMPTS, NEW, SAMPLING), (PROMPTS[:1], NEW, dict(greedy=True)),
             (PROMPTS, NEW - 2, dict(greedy=True)), (PROMPTS[::-1], NEW, dict(greedy=True)), "change a weight",
             (PROMPTS, NEW, dict(greedy=True))]
    result = []
    for call in calls:
        if call == "change a weight":
            with torch.no_grad():
                model.transformer.layers[0].mlp.dense_h_to_4h.weight.mul_(1.5)
            continue
        prompts, new, sampling = call
        before = len(recordings)
        tokens = generate(model, prompts, new, cuda_graph=capture, **sampling)
        result.append((tokens == generate(model, prompts, new, static_cache=False, **sampling),
                       len(recordings) - before))
    return result


def test_repeated_calls_of_one_shape_reuse_the_capture():
    result = run_distributed(_repeated_calls, 1, model_parallel_size=1)[0]
    assert all(equal for equal, _ in result)
    # (batch 3, length 21) captured; sampled at that shape reuses it; batch 1 and length 19 are new shapes; other
    # prompts of the first shape reuse it; after a weight changed in place (CPU: the layouts are copies) a new one
    assert [captures for _, captures in result] == [1, 0, 1, 1, 0, 1]


# ---- the stand-in itself -----------------------------------------------------------------------------------------
def _host_reads():
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    return {".item()": lambda: x * x[1].item(), "bool(t)": lambda: x * 2 if bool(x[1] > 0) else x,
            ".tolist()": lambda: x.split((x[1:2] * 6).long().tolist()), "nonzero": lambda: x[x.nonzero()],
            "boolean index": lambda: x[mask], "torch.tensor": lambda: x + torch.tensor([1.0]),
            "torch.equal": lambda: x * torch.equal(x, x)}


def test_strict_capture_refuses_every_host_read():
    from megatron.text_generation.capture import HostReadInCapture, strict_capture
    named = {".item()": "_local_scalar_dense", "bool(t)": "is_nonzero|_local_scalar_dense",
             ".tolist()": "Tensor.tolist", "nonzero": "aten.nonzero", "boolean index": "aten.index.Tensor",
             "torch.tensor": "aten.lift_fresh", "torch.equal": "aten.equal"}
    for what, forward in _host_reads().items():
        forward()                                       # each runs eagerly (the warm-ups)
        with pytest.raises(HostReadInCapture, match=named[what]):
            strict_capture(forward)
    assert torch.ones(2).tolist() == [1.0, 1.0]                # the host copies work again after


def test_strict_capture_replays_the_recording_with_its_scalars_frozen():
    """A replay re-executes the recorded ops on the same input buffers (their new values are seen) with the Python
    numbers of the capture (a host-side counter is not): as a CUDA graph does. forward() runs only at capture."""
    from megatron.text_generation.capture import strict_capture
    recordings = []
    buffer, host_length, calls = torch.zeros(4), [1], []

    def forward():
        calls.append(1)
        return (buffer[:host_length[0]].sum() + host_length[0]).expand(2).clone()
    replay = strict_capture(forward, recordings=recordings)
    assert len(calls) == 3 and torch.equal(replay(), torch.tensor([1.0, 1.0]))
    buffer.copy_(torch.tensor([5.0, 7.0, 9.0, 11.0]))
    host_length[0] = 3                                  # eager: 5 + 7 + 9 + 3 = 24
    first, second = replay(), replay()
    assert torch.equal(first, torch.tensor([6.0, 6.0])) and first is second      # buffer[:1] + 1, one output
    assert len(calls) == 3 and "aten.slice.Tensor" in recordings[0].op_names()
