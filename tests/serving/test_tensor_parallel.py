"""A tp-2 server (torchrun, gloo, 2 processes: rank 0 serves, rank 1 follows each batch by broadcast) gives the
tp-1 server's greedy completions token for token, batched and streamed, and the same prompt log-probabilities."""
from tests.serving.conftest import start_server

PROMPTS = ["The game began development in 2010", "Valkyria", "It met with positive sales in Japan , and was"]


def _answers(server):
    batch = server.post("/v1/completions", {"prompt": PROMPTS, "max_tokens": 10, "temperature": 0,
                                            "logprobs": 1, "echo": True})[1]
    chunks = server.stream("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                                               "stream": True, "stop": "\n\n"})
    return batch["choices"], "".join(c["choices"][0]["text"] for c in chunks)


def test_tensor_parallel_server_equals_single(checkpoint, server):
    single, single_stream = _answers(server)
    with start_server(checkpoint, ["--tensor-model-parallel-size", "2"], nproc=2) as parallel:
        split, split_stream = _answers(parallel)
        assert parallel.request("GET", "/v1/models")[1]["data"][0]["iteration"] == 3
    assert [c["logprobs"]["tokens"] for c in split] == [c["logprobs"]["tokens"] for c in single]
    assert [c["text"] for c in split] == [c["text"] for c in single]
    assert split_stream == single_stream
    for ours, theirs in zip(split, single):
        assert ours["logprobs"]["token_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(ours["logprobs"]["token_logprobs"][1:],
                                              theirs["logprobs"]["token_logprobs"][1:])) < 1e-5
