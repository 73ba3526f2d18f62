"""Static decoding (generation.DecodeStep): the one-token steps at fixed shapes over the whole preallocated cache,
under a mask, give token for token what the growing-cache path gives (greedy and seeded sampling, batch 1 and a
left-padded batch of 3, model-parallel 1 and 2) and what Hugging Face's generate gives; the steps read only
buffers made once per call, so a replay that takes no arguments (what a CUDA graph is) gives the same tokens."""
import pytest
import torch

from megatron.spawn import run_distributed
from tests.inference.test_generation import _hf_greedy, build_model

PROMPTS = [[5, 9, 3, 17, 40, 2, 8], [11], [60, 61, 7, 33]]       # lengths 7, 1, 4: left padding 0, 6, 3
NEW = 14                                                         # 7 + 14 = 21 of 24 positions
SAMPLING = dict(greedy=False, temperature=0.9, top_k=20, seed=5)


def replaying_capture(record):
    """A stand-in for cuda_graph_capture on the CPU: the first call runs forward (the warm-up), then every replay
    calls forward() again with no arguments, into one output tensor, as a graph replays its kernels on the
    buffers it captured. `record` gets each replay's output tensor."""
    def capture(forward):
        output = forward().clone()

        def replay():
            output.copy_(forward())
            record.append(output)
            return output
        return replay
    return capture


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
    from megatron.text_generation.generation import cuda_graph_capture, graph_capture_default
    model = build_model()
    result = {}
    for name, prompts in (("one", PROMPTS[:1]), ("three", PROMPTS)):
        for mode, sampling in (("greedy", dict(greedy=True)), ("sampled", SAMPLING)):
            result[name, mode] = {"static": generate(model, prompts, NEW, **sampling),
                                  "growing": generate(model, prompts, NEW, static_cache=False, **sampling)}
    replays = []
    result["replayed"] = generate(model, PROMPTS, NEW, greedy=True, cuda_graph=replaying_capture(replays))
    result["replay_outputs"] = len({id(output) for output in replays}), len(replays)
    result["steps"] = _steps_seen(model, PROMPTS, greedy=True)[1]
    result["defaults"] = (graph_capture_default(torch.device("cpu")),
                          graph_capture_default(torch.device("cuda")) is cuda_graph_capture,
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
    distinct, replays = result["replay_outputs"]
    assert (distinct, replays) == (1, NEW - 1)     # every one-token step a replay, into one output tensor


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
