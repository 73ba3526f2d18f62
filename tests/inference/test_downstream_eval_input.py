"""Bad --eval-tasks input is one line at start, before the model is built (megatron/text_generation/lm_eval_tasks.py,
megatron/arguments.py): flags, an unknown task, a task whose data is on the hub (offline here), a task type the
model cannot score; and the per-task log line's format."""
import os
import re
import sys

import pytest

from tests.helpers import parser_error, REPO, TINY_SHAPE
from tests import warm_python

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # a hub dataset fails at once instead of after retries
TINY = TINY_SHAPE + ["--mock-data"]
HUB_TASK = "task: hub_mc\ndataset_path: Rowan/hellaswag\ntest_split: validation\noutput_type: multiple_choice\n" \
           "doc_to_text: '{{ctx}}'\ndoc_to_choice: '{{endings}}'\ndoc_to_target: label\n"


def _task_dir(path, name, body, data=True):
    """A task YAML `name` over a two-line local JSON file (unless the body names its own data)."""
    path.mkdir(exist_ok=True)
    (path / "docs.jsonl").write_text('{"q": "a b", "label": 0}\n{"q": "c d", "label": 1}\n')
    local = (f"dataset_path: json\ndataset_kwargs: {{data_files: {{test: {path / 'docs.jsonl'}}}, "
             f"cache_dir: {path / 'hf'}}}\ntest_split: test\n") if data else ""
    (path / f"{name}.yaml").write_text(f"task: {name}\n{local}{body}")
    return str(path)


@pytest.mark.parametrize("flags,wanted", [
    (["--eval-tasks-interval", "5"], "--eval-tasks-interval applies to --eval-tasks"),
    (["--eval-tasks-limit", "5"], "--eval-tasks-limit applies to --eval-tasks"),
    (["--eval-tasks", "x", "--eval-tasks-interval", "0"], "--eval-tasks-interval is 0: it must be a positive"),
    (["--eval-tasks", "x", "--eval-tasks-path", "/no/such/dir"], "--eval-tasks-path /no/such/dir: no such directory"),
    (["--eval-tasks", "x"], "--eval-tasks reads text through the BPE tokenizer: drop --mock-data"),
])
def test_eval_task_flags_are_one_line(flags, wanted, capsys):
    from megatron.arguments import parse_args
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + flags, capsys)
    assert wanted in line


def test_unknown_task_names_the_task_and_the_nearest(tmp_path):
    from megatron.text_generation.lm_eval_tasks import load_tasks, TaskError
    path = _task_dir(tmp_path / "tasks", "local_mc", "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                                     "doc_to_choice: ['x', 'y']\ndoc_to_target: label\n")
    with pytest.raises(TaskError, match=r"unknown task 'hellaswagg' \(did you mean hellaswag.*\): no task YAML in "
                                        r"--eval-tasks-path .* or among lm-eval's tasks"):
        load_tasks(["local_mc", "hellaswagg"], path)


def test_a_task_needing_the_hub_is_one_line(tmp_path):
    from megatron.text_generation.lm_eval_tasks import load_tasks, TaskError
    path = _task_dir(tmp_path / "tasks", "hub_mc", HUB_TASK.split("\n", 1)[1], data=False)
    with pytest.raises(TaskError, match=r"must be downloaded from the Hugging Face hub, which cannot be reached "
                                        r"\(.*Rowan/hellaswag.*\).*--eval-tasks-path DIR"):
        load_tasks(["hub_mc"], path)


@pytest.mark.parametrize("extra,wanted", [
    ("doc_to_image: q\n", "task 'odd' needs images; the GPT-2 model reads text only"),
    ("unsafe_code: true\n", "task 'odd' runs generated code, which is not run during training"),
    ("metric_list:\n  - metric: bypass\n", "task 'odd' has no metric (bypass): nothing to report")])
def test_a_task_the_model_cannot_score_is_one_line(tmp_path, extra, wanted):
    from megatron.text_generation.lm_eval_tasks import load_tasks, TaskError
    path = _task_dir(tmp_path / "tasks", "odd", "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                                "doc_to_choice: ['x', 'y']\ndoc_to_target: label\n" + extra)
    with pytest.raises(TaskError, match=f"^--eval-tasks: {re.escape(wanted)}$"):
        load_tasks(["odd"], path)


def test_an_unscorable_task_type_stops_pretraining_in_one_line_before_the_model(tmp_path, webtext_data):
    """pretrain_gpt.py itself: exit status 1, one line, nothing built or trained."""
    path = _task_dir(tmp_path / "tasks", "regress", "output_type: regression\ndoc_to_text: '{{q}}'\n"
                                                    "doc_to_target: label\n")
    done = warm_python.run([sys.executable, "pretrain_gpt.py", "--train-data", "webtext", "--vocab-file",
                            os.path.join(webtext_data, "vocab.json"), "--merge-file",
                            os.path.join(webtext_data, "merges.txt"), *TINY_SHAPE, "--train-iters", "1",
                            "--eval-tasks", "regress", "--eval-tasks-path", path],
                           cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: --eval-tasks: regress cannot be loaded by lm-eval: Got invalid output_type 'regression'")
    assert "building GPT2 model" not in done.stdout and "iteration" not in done.stdout


def test_the_log_line_names_the_task_and_each_metric_with_its_stderr(capsys):
    from megatron.trainer.downstream_eval import DownstreamEval
    metrics = {"hellaswag": {"acc": 0.28714, "acc_stderr": 0.01432, "acc_norm": 0.299},
               "wikitext": {"word_perplexity": 31.25}}
    DownstreamEval()._report(200, metrics, 1.0, 10)
    assert capsys.readouterr().out.splitlines() == [
        " downstream eval at iteration 200 | hellaswag | acc: 0.2871 ± 0.0143 | acc_norm: 0.2990",
        " downstream eval at iteration 200 | wikitext | word_perplexity: 31.2500"]
