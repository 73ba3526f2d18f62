"""lm-eval's own `local-completions` model (lm_eval.models.openai_completions, unmodified) pointed at the server,
tokenizing through the server's vLLM-style /tokenize: per-request log-likelihoods equal our in-process
`megatron_gpt2` model's (another process, the same checkpoint) within 1e-5, the same greedy flags, and the same
greedy generate_until texts."""
import os

import pytest

from megatron.spawn import run_distributed

# lm-eval's API models need its [api] extra; tenacity is the one piece the locked test extras lack (issue 70)
pytest.importorskip("tenacity", reason="lm-eval's local-completions needs tenacity (pip install lm-eval[api])")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LOGLIKELIHOOD = [("The game began", " development in 2010"), ("The", " the"), ("In", " the"), ("and", " ,"),
                 ("It met with positive sales in Japan , and was praised by both Japanese", " and western critics")]
GENERATE = [("The game began development in", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
            ("Valkyria", {"until": [" the"], "max_gen_toks": 8})]


def _instances():
    from lm_eval.api.instance import Instance
    return ([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(LOGLIKELIHOOD)],
            [Instance("generate_until", {}, (context, dict(kwargs)), i) for i, (context, kwargs) in enumerate(GENERATE)])


def _in_process(megatron_args):
    from lm_eval.api.registry import get_model
    from megatron.text_generation import lm_eval_model
    lm = get_model(lm_eval_model.MODEL_NAME).create_from_arg_string(f"megatron_args={megatron_args},batch_size=4")
    loglikelihood, until = _instances()
    return lm.loglikelihood(loglikelihood), lm.generate_until(until)


def test_local_completions_equals_in_process_model(checkpoint, server, monkeypatch):
    from lm_eval.api.registry import get_model
    import lm_eval.models.openai_completions  # noqa: F401  (registers local-completions)
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    ours = run_distributed(_in_process, 1, args=(" ".join(checkpoint.model_args),))[0]
    model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
    remote = get_model("local-completions").create_from_arg_string(
        f"base_url={server.url}/v1/completions,model={model},tokenizer_backend=remote,max_length=64,"
        f"auth_token={server.api_key},"
        "max_gen_toks=8,batch_size=2")
    assert remote.tokenizer_backend == "remote"
    loglikelihood, until = _instances()
    theirs = remote.loglikelihood(loglikelihood)
    assert [greedy for _, greedy in theirs] == [greedy for _, greedy in ours[0]]
    assert max(abs(a - b) for (a, _), (b, _) in zip(theirs, ours[0])) < 1e-5, (theirs, ours[0])
    assert remote.generate_until(until) == ours[1]
