"""The copy-paste launches of docs/training.md (context parallelism) and docs/models.md (MoE with expert
parallelism) run as written, at a tiny size set through the scripts' variables, and the start-up line names the
layout they ask for."""
import os
import re
import shlex

import pytest

from tests.helpers import REPO, run_script, SCRIPT_TEST_SHAPE

TINY_RUN = dict(SCRIPT_TEST_SHAPE, TRAIN_ITERS="2", LOG_INTERVAL="1", EVAL_ITERS="1", EVAL_INTERVAL="1000")


def documented_launch(doc, needle):
    """The one launch line of `doc` that contains `needle`: (its environment, its script)."""
    text = open(os.path.join(REPO, "docs", doc)).read()
    lines = [line for line in re.findall(r"^GPUS_PER_NODE=.*$", text, re.M) if needle in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[-2] == "bash", words
    return dict(word.split("=", 1) for word in words[:-2]), os.path.basename(words[-1])


@pytest.mark.parametrize("doc, needle, layout", [
    ("training.md", "--context-parallel-size 2",
     "> layout: tensor-parallel 1, pipeline-parallel 1, context-parallel 2, data-parallel 1, expert-parallel 1;"),
    ("models.md", "--expert-model-parallel-size 2",
     "> layout: tensor-parallel 1, pipeline-parallel 1, context-parallel 1, data-parallel 2, expert-parallel 2 "
     "(expert-data-parallel 1);")])
def test_documented_launch_runs_as_written(tmp_path, doc, needle, layout):
    env, script = documented_launch(doc, needle)
    stdout = run_script(script, dict(TINY_RUN, CHECKPOINT_PATH=str(tmp_path / "ckpt"), **env))
    assert any(line.startswith(layout) for line in stdout.splitlines()), stdout[:3000]
    assert len(re.findall(r"^ iteration +\d+/ +2 \|", stdout, re.M)) == 2, stdout[-3000:]


def test_the_llama_losses_docs_models_quotes_are_what_the_command_prints(tmp_path):
    """docs/models.md quotes `TRAIN_ITERS=4 LOG_INTERVAL=1 bash scripts/pretrain_llama.sh`'s losses at iterations 3
    and 4: the command as written (default data, the CPU recipe) prints them. Within 2e-5: the printed digits here;
    another CPU's kernels may round the last one differently, a stale number (another recipe) is off by > 0.1."""
    text = open(os.path.join(REPO, "docs", "models.md")).read()
    quoted = re.search(r"`TRAIN_ITERS=4 LOG_INTERVAL=1 bash scripts/pretrain_llama.sh` on the CPU prints the losses "
                       r"(\S+) and (\S+) at\s+iterations 3 and 4", text)
    assert quoted, "docs/models.md no longer quotes the Llama losses where this test reads them"
    stdout = run_script("pretrain_llama.sh", dict(TRAIN_ITERS="4", LOG_INTERVAL="1",
                                                  CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    printed = [float(x) for x in re.findall(r"^ iteration +[34]/ +4 \|.*?\| lm loss: (\S+) \|", stdout, re.M)]
    assert printed == pytest.approx([float(x) for x in quoted.groups()], abs=2e-5), (printed, quoted.groups())
