"""lm-eval's own `local-completions` model (lm_eval.models.openai_completions, unmodified) pointed at the server,
tokenizing through the server's vLLM-style /tokenize, against our in-process `megatron_gpt2` model (another
process, the same checkpoint): on a local multiple-choice task (test_downstream_eval's, JSON lines, nothing from
the hub) every document's log-likelihoods within 1e-5 and the same greedy flags and accuracy; on single
requests the same log-likelihoods, and the same greedy generate_until texts."""
import os

import pytest

from megatron.spawn import run_distributed

# lm-eval's API models need its [api] extra; tenacity is the one piece the locked test extras lack (issue 70)
pytest.importorskip("tenacity", reason="lm-eval's local-completions needs tenacity (pip install lm-eval[api])")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LOGLIKELIHOOD = [("The game began", " development in 2010"), ("", "Valkyria Chronicles"), ("In", " the"), ("and", " ,"),
                 ("It met with positive sales in Japan , and was praised by both Japanese", " and western critics")]
GENERATE = [("The game began development in", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
            ("Valkyria", {"until": [" the"], "max_gen_toks": 8})]


def _instances():
    from lm_eval.api.instance import Instance
    return ([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(LOGLIKELIHOOD)],
            [Instance("generate_until", {}, (context, dict(kwargs)), i) for i, (context, kwargs) in enumerate(GENERATE)])


def _local_task(lm, tasks_dir):
    """{doc_id: (responses, metrics)} of the local multiple-choice task on `lm`."""
    from megatron.text_generation.lm_eval_tasks import document_scores, load_tasks, run_tasks
    results = run_tasks(lm, load_tasks(["local_mc"], path=tasks_dir))
    return {doc: (responses, metrics) for doc, responses, metrics in document_scores(results)["local_mc"]}


def _in_process(megatron_args, tasks_dir):
    from lm_eval.api.registry import get_model
    from megatron.text_generation import lm_eval_model
    lm = get_model(lm_eval_model.MODEL_NAME).create_from_arg_string(f"megatron_args={megatron_args},batch_size=4")
    loglikelihood, until = _instances()
    return lm.loglikelihood(loglikelihood), lm.generate_until(until), _local_task(lm, tasks_dir)


def _close(ours, theirs):
    """Log-likelihoods within 1e-5 and the same greedy flags, response by response."""
    assert [greedy for _, greedy in theirs] == [greedy for _, greedy in ours]
    assert max(abs(a - b) for (a, _), (b, _) in zip(theirs, ours)) < 1e-5, (theirs, ours)


def test_local_completions_equals_in_process_model(checkpoint, server, monkeypatch, tmp_path):
    from lm_eval.api.registry import get_model
    import lm_eval.models.openai_completions  # noqa: F401  (registers local-completions)
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    from tests.inference.test_downstream_eval import write_tasks
    tasks_dir = write_tasks(str(tmp_path))
    ours = run_distributed(_in_process, 1, args=(" ".join(checkpoint.model_args), tasks_dir))[0]
    model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
    remote = get_model("local-completions").create_from_arg_string(
        f"base_url={server.url}/v1/completions,model={model},tokenizer_backend=remote,max_length=64,"
        f"auth_token={server.api_key},"
        "max_gen_toks=8,batch_size=2")
    assert remote.tokenizer_backend == "remote"
    loglikelihood, until = _instances()
    _close(ours[0], remote.loglikelihood(loglikelihood))
    assert remote.generate_until(until) == ours[1]
    task = _local_task(remote, tasks_dir)
    assert sorted(task) == sorted(ours[2]) and len(task) == 9
    for doc, (responses, metrics) in task.items():
        _close([r[0] for r in ours[2][doc][0]], [r[0] for r in responses])
        assert metrics == ours[2][doc][1]
