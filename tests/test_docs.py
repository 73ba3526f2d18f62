"""The README and docs/ stay true: every entry point they name answers `--help` with exit status 0, every long flag
they give a named entry point is one of its flags, every repository path and relative link they name exists (and
a link's #anchor is a heading of its page), and the README stays a front page of at most 160 lines.

The `--help` runs happen in one fresh interpreter (_HELP_RUNNER): each Python entry point is executed as `__main__`
with `sys.argv = [path, "--help"]`, which is what `python path --help` does, while torch and the package are
imported once instead of once per tool (~5 s for all of them, not ~3 s each). The shell script and lm-eval's
`run --help` run beside it in processes of their own."""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.helpers import REPO
from tests import warm_python


README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
README_MAX_LINES = 160

# lm-eval 0.4.13's top-level --help lists its subcommands; the flags the docs give it (the legacy form, where `run`
# is implied) are in `run --help`.
SUBCOMMAND_HELP = {"megatron.text_generation.lm_eval_model": [["run"]]}
# Flags of programs that are not ours, as the docs use them (torchrun's, pytest's --device from tests/conftest.py).
EXTERNAL_FLAGS = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port", "--standalone",
                  "--max-restarts", "--rdzv-backend", "--rdzv-endpoint", "--device", "--help",
                  "--no-deps", "--only-binary", "--python-version", "--system-site-packages",   # pip's, venv's
                  "--min_replicas", "--quorum_tick_ms", "--join_timeout_ms", "--bind"}   # torchft_lighthouse's

_HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
out_path, targets = sys.argv[1], json.loads(sys.argv[2])
results = {}
for kind, name, argv in targets:
    stdout, stderr, saved_argv, saved_path = io.StringIO(), io.StringIO(), sys.argv, list(sys.path)
    code = "ran to the end without exiting: --help was not handled"
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            sys.argv = [name] + argv
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(name)))   # as `python path` puts it first
                runpy.run_path(name, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) or exit_.code is None else str(exit_.code)
    except BaseException as error:   # reported, not raised: the other tools still run
        code = f"raised {type(error).__name__}: {error}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    results[" ".join([name] + argv)] = {"code": code, "stdout": stdout.getvalue(),
                                        "stderr": stderr.getvalue()[-2000:]}
with open(out_path, "w") as handle:
    json.dump(results, handle)
"""

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
_ENTRY = re.compile(r"(?<![\w./-])((?:tools|tasks)/(?:bench/)?\w+\.(?:py|sh)|pretrain_gpt\.py|finetune_gpt\.py|train_reward_model\.py|train_rlhf\.py)\b")
_MODULE = re.compile(r"python -m ((?:megatron|tools|tasks)(?:\.\w+)+)")
_LONG_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
_REPO_PATH = re.compile(r"(?<![\w./:-])((?:megatron|mpu|tools|tasks|scripts|tests|docs|data)/[\w./-]*[\w/]|"
                        r"pretrain_gpt\.py|Makefile|requirements(?:-test)?\.txt)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _pages():
    return [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def _read(page):
    with open(page, encoding="utf-8") as handle:
        return handle.read()


def _relative(page):
    return os.path.relpath(page, REPO)


def _code(text):
    """Every piece of code in a page: each logical line of a fenced block (backslash continuations joined), then
    each inline code span (the text outside the fenced blocks)."""
    pieces = []
    for block in _FENCE.findall(text):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += _SPAN.findall(_FENCE.sub("", text))
    return pieces


def _entry_points():
    """{name: kind} of the entry points the pages name: repository paths (`script`) and `python -m` modules."""
    found = {}
    for page in _pages():
        for piece in _code(_read(page)):
            for path in _ENTRY.findall(piece):
                if path.endswith(".sh") or _is_main(path):
                    found[path] = "script"
            for module in _MODULE.findall(piece):
                found[module] = "module"
    return found


def _is_main(path):
    full = os.path.join(REPO, path)
    return os.path.isfile(full) and re.search(r"^if __name__ == .__main__.:", _read(full), re.M) is not None


def _own_process(name, kind, argv):
    """The command line of a --help run in a process of its own: shell scripts, and the subcommands' help of
    lm-eval's module (it registers the model when it runs, so it runs once per interpreter)."""
    if name.endswith(".sh"):
        return ["bash", name] + argv
    return [sys.executable, "-m", name] + argv if kind == "module" else [sys.executable, name] + argv


@pytest.fixture(scope="module")
def helps():
    """{command ("NAME --help"): {"code", "stdout", "stderr"}}: every Python entry point's --help in one
    interpreter; beside it, in processes of their own, tools/gpu_check.sh and `lm_eval_model run --help`."""
    entries = _entry_points()
    if "megatron.text_generation.lm_eval_model" in entries:
        pytest.importorskip("lm_eval")    # a test requirement; its command line is the harness's
    own = [(name, kind, ["--help"]) for name, kind in sorted(entries.items()) if name.endswith(".sh")]
    own += [(name, entries[name], sub + ["--help"]) for name, subs in SUBCOMMAND_HELP.items() if name in entries
            for sub in subs]
    shared = [(kind, name, ["--help"]) for name, kind in sorted(entries.items()) if not name.endswith(".sh")]
    processes = {" ".join([name] + argv): warm_python.Popen(_own_process(name, kind, argv), cwd=REPO,
                                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, kind, argv in own}
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "helps.json")
        runner = warm_python.run([sys.executable, "-c", _HELP_RUNNER, out_path, json.dumps(shared)], cwd=REPO,
                                 capture_output=True, text=True, timeout=300)
        assert os.path.exists(out_path), runner.stderr[-3000:]
        runs = json.loads(_read(out_path))
    for command, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        runs[command] = {"code": process.returncode, "stdout": stdout, "stderr": stderr[-2000:]}
    return runs


def _help_of(helps, name):
    """The --help text of an entry point (with its subcommands' help, if any)."""
    return "\n".join(result["stdout"] for command, result in helps.items() if command.split()[0] == name)


def test_docs_name_the_entry_points():
    """The extraction itself: the front page's commands and the tools the docs describe are found."""
    entries = _entry_points()
    for name in ("pretrain_gpt.py", "tasks/main.py", "tools/preprocess_data.py", "tools/zero_to_fp32.py",
                 "tools/checkpoint_util.py", "tools/convert_to_hf.py", "tools/estimate_memory.py",
                 "tools/bench/bench_zero.py", "tools/gpu_check.sh", "megatron.text_generation.lm_eval_model"):
        assert name in entries, name
    assert len(entries) >= 15, sorted(entries)


def test_every_entry_point_answers_help(helps):
    failed = {name: (result["code"], result["stderr"].strip().splitlines()[-3:])
              for name, result in helps.items() if result["code"] not in (0, None) or not result["stdout"].strip()}
    assert not failed, failed


def _flags(help_text):
    return set(_LONG_FLAG.findall(help_text))


def test_flags_given_to_an_entry_point_are_its_flags(helps):
    """In each command (a code line or span naming an entry point), the long flags after the entry point's name,
    up to a comment, are in its --help; double-quoted strings (a flag string handed on, as lm-eval's
    --model_args "megatron_args=...") are left out."""
    wrong, entries = [], _entry_points()
    for page in _pages():
        for piece in _code(_read(page)):
            match = _ENTRY.search(piece) or _MODULE.search(piece)
            if match is None or match.group(1) not in entries:
                continue
            rest = re.sub(r'"[^"]*"', "", re.split(r"\s#\s", piece[match.end():])[0])
            known = _flags(_help_of(helps, match.group(1))) | {"--help"}
            wrong += [f"{_relative(page)}: {match.group(1)} {flag}" for flag in _LONG_FLAG.findall(rest)
                      if flag not in known]
    assert not wrong, wrong


def test_every_flag_named_is_a_flag_of_something(helps):
    """Any long flag in the pages' code is a flag of one of our entry points (or of torchrun/pytest)."""
    known = set(EXTERNAL_FLAGS)
    for result in helps.values():
        known |= _flags(result["stdout"])
    wrong = sorted({f"{_relative(page)}: {flag}" for page in _pages() for piece in _code(_read(page))
                    for flag in _LONG_FLAG.findall(piece) if flag not in known})
    assert not wrong, wrong


def test_named_repository_paths_exist():
    """Paths in the pages' code (megatron/..., tools/..., scripts/..., tests/...) exist; templates with
    placeholders ({tp:02d}, ..., X) and the generated data/webtext/ and data/sft/ files are not paths."""
    missing = []
    for page in _pages():
        for piece in _code(_read(page)):
            for path in _REPO_PATH.findall(piece):
                if re.search(r"[{}*<>]|\.\.\.|(^|/)X\b", path) or path.startswith(("data/webtext", "data/sft")):
                    continue
                if not os.path.exists(os.path.join(REPO, path)):
                    missing.append(f"{_relative(page)}: {path}")
    assert not missing, missing


def _slug(heading):
    """GitHub's anchor of a heading: the rendered text lower-cased, punctuation but - and _ dropped, spaces -> -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page):
    slugs, seen = set(), {}
    for heading in _HEADING.findall(_FENCE.sub("", _read(page))):
        slug = _slug(heading)
        slugs.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return slugs


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in _LINK.findall(_FENCE.sub("", _read(page))):
            if re.match(r"[a-z]+:", target):
                continue                                  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                broken.append(f"{_relative(page)}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                broken.append(f"{_relative(page)}: {target} (no such heading in {_relative(full)})")
    assert not broken, broken


def test_slug_matches_github():
    assert _slug("ZeRO (`python tools/bench_zero.py`)") == "zero-python-toolsbench_zeropy"
    assert _slug("Command line vs ds_config.json") == "command-line-vs-ds_configjson"
    assert _slug("Hangs: timeouts, breadcrumbs, stack dumps") == "hangs-timeouts-breadcrumbs-stack-dumps"


def test_readme_is_a_front_page():
    """At most README_MAX_LINES lines; its first screen (40 lines) gives the two commands, each with a one-line
    description (a `# ...` comment that fits one 120-character line: timings and test-runner internals live in
    docs/testing.md), and says where to go next (a link into docs/)."""
    with open(README, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"
    first_screen = lines[:40]
    for command in ("make pretrain", "make test"):
        described = [line for line in first_screen if re.match(rf"{command}\s+# \S", line)]
        assert described, f"`{command}  # what it does` is not within README.md's first 40 lines"
        assert len(described[0]) <= 120, f"{command}'s line is {len(described[0])} characters: {described[0]}"
    assert any("](docs/" in line for line in first_screen), "the first screen links nowhere into docs/"
