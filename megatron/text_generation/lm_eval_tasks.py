"""lm-evaluation-harness tasks run on our harness model (lm_eval_model.MegatronGPT2LM): the harness loads the tasks,
builds the requests, splits the documents over the data-parallel ranks and computes the metrics; we only score.

    tasks = load_tasks(["local_mc", "local_ppl"], path="my_tasks/")   # once, at start: bad input is a TaskError
    results = run_tasks(lm, tasks, limit=500)   # every data-parallel rank; the harness's results on dp rank 0
    metrics = task_metrics(results)              # {"local_mc": {"acc": 0.29, "acc_stderr": 0.01, ...}, ...}

run_tasks is what the harness's simple_evaluate (its CLI) does around evaluate() for these tasks, without its
environment report: the same seeds (python 0, numpy and torch 1234) and fewshot seed, 0 shots unless a task sets
them, every per-document sample logged. A caller that must not disturb its own random streams (training) runs it
inside megatron.checkpoint.preserved_rng_state.

Tasks are looked up in `path` (a directory of task YAMLs, e.g. a local JSON-lines task) first; only a name not
found there makes the harness index its own ~15,000 tasks (seconds). Unknown names, a task whose data must come
from the hub and cannot, and a task our text model cannot score are one-line TaskErrors.
"""
import difflib
import random

import numpy as np
import torch

from megatron.cli import UserError

SCORABLE = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
"""The harness's output types MegatronGPT2LM answers (its loglikelihood, loglikelihood_rolling, generate_until)."""
SEED, OTHER_SEED = 0, 1234
"""simple_evaluate's defaults: random.seed(SEED); numpy, torch and the fewshot sampler seeded with OTHER_SEED."""
BOOTSTRAP_ITERS = 100000
"""simple_evaluate's default (closed-form stderrs, e.g. of acc, need it above 0; perplexities have none)."""


class TaskError(UserError, ValueError):
    """An lm-eval task that cannot be run here (unknown, data unreachable, not scorable): one line at start."""


def _lm_eval():
    try:
        import lm_eval.evaluator
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise TaskError(f"--eval-tasks needs lm-evaluation-harness ({error}): pip install lm-eval==0.4.13") from None
    return lm_eval.evaluator, TaskManager


def _task_manager(names, path):
    """The harness's TaskManager over `path`; the harness's own tasks indexed only when a name is not in `path`."""
    _, TaskManager = _lm_eval()
    if path is not None:
        local = TaskManager(include_path=path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=path)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        near = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        where = f"in --eval-tasks-path {path} or " if path else ""
        raise TaskError(f"--eval-tasks: unknown task {unknown[0]!r}{hint}: no task YAML {where}among lm-eval's "
                        "tasks has that name; give --eval-tasks-path DIR for a local task")
    return manager


def load_tasks(names, path=None):
    """The harness's task dict for `names` ({'tasks': {name: Task}, 'groups': ...}), datasets loaded, configured as
    simple_evaluate configures them. TaskError for what cannot run, before any model work."""
    manager = _task_manager(names, path)
    try:
        loaded = manager.load(list(names))
    except ConnectionError as error:   # datasets' offline / unreachable hub
        raise TaskError(f"--eval-tasks: {', '.join(names)}: a task's data must be downloaded from the Hugging Face "
                        f"hub, which cannot be reached ({' '.join(str(error).split())}); run once with network to "
                        "fill the datasets cache, or give a local task (--eval-tasks-path DIR)") from None
    except (ValueError, KeyError, OSError, TypeError) as error:
        raise TaskError(f"--eval-tasks: {', '.join(names)} cannot be loaded by lm-eval: "
                        f"{' '.join(str(error).split())}") from None
    for name, task in loaded["tasks"].items():
        _check_scorable(name, task)
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=OTHER_SEED)
    return loaded


def _check_scorable(name, task):
    output_type = task.OUTPUT_TYPE
    if output_type not in SCORABLE:
        raise TaskError(f"--eval-tasks: task {name!r} has output_type {output_type!r}, which the GPT-2 model cannot "
                        f"score (it answers {', '.join(SCORABLE)})")
    if getattr(task, "MULTIMODAL", False):
        raise TaskError(f"--eval-tasks: task {name!r} needs images; the GPT-2 model reads text only")
    if getattr(task, "UNSAFE_CODE", False):
        raise TaskError(f"--eval-tasks: task {name!r} runs generated code, which is not run during training")
    if "bypass" in getattr(task, "_metric_fn_list", {}):
        raise TaskError(f"--eval-tasks: task {name!r} has no metric (bypass): nothing to report")


def run_tasks(lm, loaded, limit=None):
    """lm_eval.evaluator.evaluate on `lm` (a MegatronGPT2LM) with simple_evaluate's seeds: the harness's results
    dict with every sample logged on data-parallel rank 0, None on the other data-parallel ranks."""
    evaluator, _ = _lm_eval()
    random.seed(SEED)
    np.random.seed(OTHER_SEED)
    torch.manual_seed(OTHER_SEED)
    return evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=BOOTSTRAP_ITERS,
                              log_samples=True)


def task_metrics(results):
    """{task: {metric: value}} from the harness's results: 'acc,none' -> 'acc', 'acc_stderr,none' -> 'acc_stderr',
    another filter kept after a slash ('exact_match,strict-match' -> 'exact_match/strict-match'); a stderr the
    harness has not computed ('N/A') is left out."""
    metrics = {}
    for task, values in results["results"].items():
        out = metrics.setdefault(task, {})
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            out[metric if filter_name == "none" else f"{metric}/{filter_name}"] = float(value)
    return metrics


def document_scores(results):
    """{task: [(doc_id, the model's responses, {metric: value}), ...] sorted by doc_id}: the per-document record
    (from the logged samples) two evaluations are compared by."""
    scores = {}
    for task, samples in results["samples"].items():
        scores[task] = sorted(((sample["doc_id"], sample["resps"], {name: sample[name] for name in sample["metrics"]})
                               for sample in samples), key=lambda score: score[0])
    return scores
