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
