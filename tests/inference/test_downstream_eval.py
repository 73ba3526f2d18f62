"""Downstream evaluation while training (--eval-tasks, megatron/trainer/downstream_eval.py) on a local multiple-choice
task and a local perplexity task (JSON-lines data, task YAMLs written here: nothing from the hub), against the
standalone harness (lm_eval's simple_evaluate on our harness model loaded from the checkpoint the run saved at
that iteration: the path of `python -m megatron.text_generation.lm_eval_model`), per document.

One launch per world size: dp 2 under ZeRO-3 trains with evaluation, trains again without it, and runs the
standalone harness at dp 2 on the first run's last checkpoint; 4 ranks train at dp 4 (ZeRO-3) and at tp 2 x dp 2
with evaluation and run the harness at dp 4 on the tp-2 checkpoint; dp 1 (ZeRO-2) trains with evaluation and runs
the standalone harness at dp 1 on its own last checkpoint and on the dp-2 and dp-4 runs' checkpoints at the
evaluation interval."""
import json
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import FIXTURES, TINY_SHAPE, set_tracker, train, write_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # nothing here may reach the hub
TASKS = ["local_mc", "local_ppl"]
LIMIT = 7            # odd: dp 2 splits the documents 4 / 3 (the harness pads the shorter rank's requests)
EVAL_AT, ITERS = 2, 3
MODEL = TINY_SHAPE + ["--make-vocab-size-divisible-by", "100"]


def write_tasks(directory):
    """A cloze multiple-choice task (a line's first words; its next three words among three other lines') and a
    rolling perplexity task (lines longer than the 16-token window among them), as lm-eval's JSON task YAMLs."""
    text = open(os.path.join(FIXTURES, "wiki.test.tokens"), encoding="utf-8").read()
    lambada = [json.loads(line)["text"] for line in open(os.path.join(FIXTURES, "lambada_test.jsonl"))]
    lines = [words for words in (sentence.split() for sentence in text.split(" . ") + lambada) if len(words) > 9]
    questions = []
    for index, words in enumerate(lines[:9]):
        others = [lines[(index + k) % len(lines)][6:9] for k in (3, 5, 7)]
        choices = [" ".join(w) for w in others[:index % 4] + [words[6:9]] + others[index % 4:]]
        questions.append({"question": " ".join(words[:6]), "choices": choices, "label": index % 4})
    _write_jsonl(os.path.join(directory, "mc.jsonl"), questions)
    _write_jsonl(os.path.join(directory, "ppl.jsonl"), [{"text": " ".join(words)} for words in lines[:9]])
    common = f"test_split: test\ndataset_path: json\n"
    for name, data, body in (
            ("local_mc", "mc.jsonl", "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                                     "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
                                     "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
            ("local_ppl", "ppl.jsonl", "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                       "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
                                       "  - metric: bits_per_byte\n")):
        kwargs = {"data_files": {"test": os.path.join(directory, data)}, "cache_dir": os.path.join(directory, "hf")}
        with open(os.path.join(directory, f"{name}.yaml"), "w") as handle:
            handle.write(f"task: {name}\n{common}dataset_kwargs: {json.dumps(kwargs)}\n{body}")
    return directory


def _write_jsonl(path, rows):
    with open(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)


def _standalone(megatron_args, tasks_dir):
    """The standalone harness: our model from its flags (as the CLI's --model_args), simple_evaluate on the tasks;
    the per-document scores (data-parallel rank 0) and how many requests this rank scored."""
    import mpu
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager
    from megatron.text_generation.lm_eval_model import MegatronGPT2LM
    from megatron.text_generation.lm_eval_tasks import document_scores, task_metrics
    lm = MegatronGPT2LM(megatron_args=megatron_args, batch_size=3)
    results = simple_evaluate(model=lm, tasks=TASKS, limit=LIMIT, log_samples=True,
                              task_manager=TaskManager(include_path=tasks_dir, include_defaults=False))
    mpu.destroy_model_parallel()
    done = results is not None
    return {"scores": document_scores(results) if done else None, "metrics": task_metrics(results) if done else None,
            "requests_scored": lm.requests_scored}


def _counting_gathers_per_evaluation():
    """([the ZeRO-3 buffers each DownstreamEval.run gathered, ...], a function undoing the count)."""
    from megatron.trainer.downstream_eval import DownstreamEval
    from tests.helpers import count_stage3_gathers
    per_evaluation, original = [], DownstreamEval.run

    def run(self, model, iteration):
        calls, undo = count_stage3_gathers()
        try:
            return original(self, model, iteration)
        finally:
            undo()
            per_evaluation.append(list(calls))
    DownstreamEval.run = run
    return per_evaluation, lambda: setattr(DownstreamEval, "run", original)


def _launch(runs):
    """Each (kind, argv) in this process: 'train' -> pretrain_gpt's history (and the ZeRO-3 gathers of each
    evaluation), 'standalone' -> _standalone."""
    import mpu
    out = []
    for kind, argv in runs:
        if kind == "train":
            gathers, undo = _counting_gathers_per_evaluation()
            try:
                out.append(dict(train(argv), gathers_per_evaluation=gathers))
            finally:
                undo()
            mpu.destroy_model_parallel()
        else:
            out.append(_standalone(*argv))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, webtext_data):
    root = tmp_path_factory.mktemp("downstream")
    tasks_dir = write_tasks(str(root))
    tokenizer = ["--vocab-file", os.path.join(webtext_data, "vocab.json"),
                 "--merge-file", os.path.join(webtext_data, "merges.txt")]

    def training(name, stage, evaluate=True, extra=()):
        config = write_config(str(root / name), zero_optimization={"stage": stage})
        argv = MODEL + tokenizer + [
            "--data-path", os.path.join(webtext_data, "webtext_text_document"), "--data-cache-path",
            str(root / "cache"), "--batch-size", "2", "--train-iters", str(ITERS), "--lr", "3e-3", "--warmup", "0",
            "--log-interval", "1", "--eval-iters", "0", "--save", str(root / name), "--save-interval", str(EVAL_AT),
            "--deepspeed", "--deepspeed_config", config, "--seed", "11"]
        if evaluate:
            argv += ["--eval-tasks", ",".join(TASKS), "--eval-tasks-path", tasks_dir, "--eval-tasks-interval",
                     str(EVAL_AT), "--eval-tasks-limit", str(LIMIT), "--log-jsonl", str(root / name / "log.jsonl")]
        return ("train", argv + list(extra))

    def standalone(name):
        return ("standalone", (" ".join(MODEL + tokenizer + ["--load", str(root / name)]), tasks_dir))

    for name in ("dp2", "dp2_plain", "dp1", "dp4", "tp2"):
        os.makedirs(root / name)
    dp2 = run_distributed(_launch, 2, args=([training("dp2", 3), training("dp2_plain", 3, evaluate=False),
                                             standalone("dp2")],))
    final_weights = [_fp32_weights(str(root / name)) for name in ("dp2", "dp2_plain")]   # at ITERS
    # 4 ranks: dp 4 (ZeRO-3) evaluates once, at its end (iteration EVAL_AT); tp 2 x dp 2 (ZeRO-2; the data-parallel
    # groups [0 2] and [1 3], results gathered to global ranks 0 and 1) evaluates at its end (iteration 1), and the
    # standalone harness reads that checkpoint at tensor-parallel 1 x data-parallel 4
    four = run_distributed(_launch, 4, args=([
        training("dp4", 3, extra=["--train-iters", str(EVAL_AT)]),
        training("tp2", 2, extra=["--train-iters", "1", "--model-parallel-size", "2"]), standalone("tp2")],))
    set_tracker(str(root / "dp2"), EVAL_AT)
    (dp1,) = run_distributed(_launch, 1, args=([training("dp1", 2), standalone("dp1"), standalone("dp2"),
                                                standalone("dp4")],))
    return {"dp2": [out[0] for out in dp2], "dp2_plain": [out[1] for out in dp2],
            "dp2_standalone": [out[2] for out in dp2], "dp1": dp1[0], "dp1_standalone": dp1[1:],
            "dp4": [out[0] for out in four], "tp2": [out[1] for out in four],
            "tp2_standalone": [out[2] for out in four],
            "log": [json.loads(line) for line in open(root / "dp2" / "log.jsonl")], "final_weights": final_weights}


def _fp32_weights(save_dir):
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    return read_full_checkpoint(save_dir).fp32_weights()


def test_tensor_parallel_2_by_data_parallel_2_equals_the_harness_at_data_parallel_4(runs):
    """tp 2 x dp 2 in training against the standalone harness on its checkpoint at tp 1 x dp 4 (documents 4 ways:
    2, 2, 2, 1)."""
    (evaluation,) = runs["tp2"][0]["downstream"]
    assert_same_documents(evaluation["scores"], runs["tp2_standalone"][0]["scores"])
    assert [r["scores"] is None for r in runs["tp2_standalone"]] == [False, True, True, True]
    assert all(r["downstream"][0]["metrics"] == evaluation["metrics"] for r in runs["tp2"])
    scored = [r["requests_scored"] for r in runs["tp2_standalone"]]
    assert min(scored) > 0 and 2 * max(scored) < sum(scored)   # four shares (the largest 2 of 7 documents)


def test_in_training_scores_at_dp4_equal_the_harness_at_dp1(runs):
    """dp 4 under ZeRO-3 (documents 2, 2, 2, 1 over the ranks, every rank's share gathered to rank 0) against the
    standalone harness at dp 1 on the checkpoint of that iteration: per document, and the same metrics on every
    rank."""
    at_end = [_in_training(rank, EVAL_AT) for rank in runs["dp4"]]
    assert [len(rank["downstream"]) for rank in runs["dp4"]] == [1] * 4
    assert_same_documents(at_end[0]["scores"], runs["dp1_standalone"][2]["scores"])
    assert [e["scores"] is None for e in at_end] == [False, True, True, True]
    for task in TASKS:
        assert at_end[0]["metrics"][task] == pytest.approx(runs["dp1_standalone"][2]["metrics"][task], rel=1e-5)
    assert all(e["metrics"] == at_end[0]["metrics"] for e in at_end)


def assert_same_documents(mine, theirs):
    """Per document: the same ids, log-likelihoods within 1e-5, the same greedy flags and accuracies."""
    assert sorted(mine) == sorted(theirs) == sorted(TASKS)
    for task in TASKS:
        assert [doc for doc, _, _ in mine[task]] == [doc for doc, _, _ in theirs[task]] == list(range(LIMIT))
        for (_, resps, metrics), (_, their_resps, their_metrics) in zip(mine[task], theirs[task]):
            assert len(resps) == len(their_resps)
            # each request's first response (the harness pads a shorter rank with copies of its last request, whose
            # extra responses its filters drop)
            for (response, *_), (their_response, *_) in zip(resps, their_resps):
                if isinstance(response, (list, tuple)):     # (log-likelihood, is greedy) of a choice
                    assert response[0] == pytest.approx(their_response[0], abs=1e-5)
                    assert response[1] == their_response[1]
                else:                                      # a rolling log-likelihood
                    assert response == pytest.approx(their_response, abs=1e-5)
            if task == "local_mc":
                assert metrics == their_metrics


def _in_training(history, iteration):
    (evaluation,) = [e for e in history["downstream"] if e["iteration"] == iteration]
    return evaluation


def test_in_training_scores_equal_the_standalone_harness_at_dp1(runs):
    """At the end of training (the last checkpoint); dp 2's test below is at the interval."""
    mine = _in_training(runs["dp1"], ITERS)
    assert_same_documents(mine["scores"], runs["dp1_standalone"][0]["scores"])
    for task in TASKS:
        assert mine["metrics"][task] == pytest.approx(runs["dp1_standalone"][0]["metrics"][task], rel=1e-5)
    assert [e["iteration"] for e in runs["dp1"]["downstream"]] == [EVAL_AT, ITERS]   # the interval, then the end


def test_in_training_scores_equal_the_standalone_harness_at_dp2_zero3(runs):
    """At the interval (the dp-1 harness on that checkpoint) and at the end (the dp-2 harness, the same split)."""
    rank0, rank1 = runs["dp2"]
    at_interval, at_end = _in_training(rank0, EVAL_AT), _in_training(rank0, ITERS)
    assert_same_documents(at_interval["scores"], runs["dp1_standalone"][1]["scores"])
    assert_same_documents(at_end["scores"], runs["dp2_standalone"][0]["scores"])
    assert at_interval["scores"] != at_end["scores"]              # training moved on in between
    assert _in_training(rank1, EVAL_AT)["scores"] is None
    for rank in (rank0, rank1):   # ZeRO-3: each buffer gathered once per evaluation (not per unit per forward)
        assert len(rank["gathers_per_evaluation"]) == 2
        assert all(names and len(names) == len(set(names)) for names in rank["gathers_per_evaluation"])
    assert _in_training(rank1, EVAL_AT)["metrics"] == at_interval["metrics"]   # every rank has the metrics
    for task in TASKS:
        assert at_interval["metrics"][task] == pytest.approx(runs["dp1_standalone"][1]["metrics"][task], rel=1e-5)
        assert at_end["metrics"][task] == pytest.approx(runs["dp2_standalone"][0]["metrics"][task], rel=1e-5)


def test_data_parallel_ranks_score_disjoint_halves(runs):
    """The standalone harness at dp 2 splits the requests too (4 and 3 of the 7 documents: every choice of a
    multiple-choice document and every window of a rolling one on the rank that holds the document)."""
    alone = runs["dp1_standalone"][1]["requests_scored"]
    first, second = (r["requests_scored"] for r in runs["dp2_standalone"])
    assert first + second >= alone > max(first, second) > 0   # padding may add a few copies to the shorter rank
    assert runs["dp2_standalone"][1]["scores"] is None


def test_training_with_evaluation_equals_training_without_bitwise(runs):
    for with_eval, plain in zip(runs["dp2"], runs["dp2_plain"]):
        assert with_eval["lm loss"] == plain["lm loss"]
        assert with_eval["grad norm"] == plain["grad norm"]
    with_eval, plain = runs["final_weights"]
    assert list(with_eval) == list(plain) and all(torch.equal(with_eval[k], plain[k]) for k in plain)


def test_metrics_are_printed_logged_and_plausible(runs):
    records = [r for r in runs["log"] if r.get("type") == "downstream"]
    assert [(r["iteration"], r["task"]) for r in records] == [(EVAL_AT, "local_mc"), (EVAL_AT, "local_ppl"),
                                                              (ITERS, "local_mc"), (ITERS, "local_ppl")]
    metrics = _in_training(runs["dp2"][0], EVAL_AT)["metrics"]
    assert records[0]["metrics"] == metrics["local_mc"]
    assert set(metrics["local_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert metrics["local_mc"]["acc"] in {k / LIMIT for k in range(LIMIT + 1)}
    assert metrics["local_ppl"]["word_perplexity"] > 1 and metrics["local_ppl"]["bits_per_byte"] > 0
