"""One base for every error a user can fix (megatron.cli.UserError, as Click's UsageError): a walk over every
module of megatron/, mpu/, tools/ (with tools/bench/), tasks/ and the top-level scripts imports each one and
collects the exception classes defined there; each must derive from UserError, or be on the allow-list below of
errors that signal a bug in our code (a user cannot cause them). run_main(main) catches UserError alone, so a new
error class that forgets the base is a traceback for a user: this walk fails instead."""
import json
import os
import sys
import textwrap

import pytest

from tests.helpers import REPO
from tests import warm_python

# Errors a user cannot cause, each with why: they must NOT derive from UserError (run_main would hide a bug).
INTERNAL_ERRORS = {
    # the tests' NCCL-rules mode (MEGATRON_NCCL_RULES=1): a collective our code issued on a host tensor
    "megatron.guards.nccl_rules.NcclRuleError",
    # the same mode's point-to-point order model: an order our code posts that NCCL would hang on
    "megatron.guards.p2p_order.P2POrderError",
    # the strict capture stand-in of the tests (and a capture's own check): a host read inside a captured step is our
    # code's bug, not the user's input
    "megatron.text_generation.capture.HostReadInCapture",
    # the training loop's signal for a skipped non-finite step; the loop turns it into NonFiniteError (a UserError)
    "megatron.guards.operations.NonFiniteStep",
    # tools/ds_client_check.py's own finding (DeepSpeed's client differs from ours), reported by its summary
    "ds_client_check.CheckFailed",
    # mpu imports only torch, so it cannot derive from UserError; the command line refuses such a length first, in
    # one line (megatron.arguments' context-parallel check): reaching this one means a library caller skipped it
    "mpu.context_parallel.SequenceLengthError",
}

# Runs in a fresh interpreter: imports each (module, path) of argv[2] and prints the exception classes defined in
# it as JSON; argv[1] is the repository (on sys.path first, as the scripts are run from it).
_WALKER = textwrap.dedent("""
    import importlib, json, sys
    repo, modules = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, repo)
    from megatron.cli import UserError
    found, failed = [], {}
    for name, directory in modules:
        if directory not in sys.path:
            sys.path.insert(1, directory)
        try:
            module = importlib.import_module(name)
        except Exception as error:          # reported: a module the walk cannot see is a failure of the walk
            failed[name] = f"{type(error).__name__}: {error}"
            continue
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                found.append({"name": f"{name}.{value.__qualname__}", "user_error": issubclass(value, UserError),
                              "bases": [base.__name__ for base in value.__mro__[1:-2]]})
    print(json.dumps({"found": found, "failed": failed}))
""")


def _modules(root):
    """[(module name, the directory it is imported from)] of every .py under `root`: packages megatron/, mpu/ and
    tasks/ by dotted name; tools/ and tools/bench/ by file name (as they import each other); the top-level
    scripts by file name."""
    modules = []
    for package in ("megatron", "mpu", "tasks"):
        for directory, _, files in os.walk(os.path.join(root, package)):
            for file in sorted(f for f in files if f.endswith(".py")):
                parts = os.path.relpath(os.path.join(directory, file), root)[:-3].split(os.sep)
                modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), root))
    for directory in (os.path.join(root, "tools"), os.path.join(root, "tools", "bench"), root):
        modules += [(f[:-3], directory) for f in sorted(os.listdir(directory))
                    if f.endswith(".py") and f != "conftest.py"]
    return modules


def _walk(modules, repo=REPO):
    result = warm_python.run([sys.executable, "-c", _WALKER, repo, json.dumps(modules)], cwd=repo,
                             capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _not_user_errors(found):
    """The classes a user can cause (not on the allow-list) that do not derive from UserError."""
    return sorted(c["name"] for c in found if not c["user_error"] and c["name"] not in INTERNAL_ERRORS)


@pytest.fixture(scope="module")
def project_errors():
    return _walk(_modules(REPO))


def test_every_module_of_the_project_is_walked(project_errors):
    assert project_errors["failed"] == {}
    names = {c["name"] for c in project_errors["found"]}
    # one of each place the walk must reach: the library, a tool, a benchmark-free tool, tasks/
    for name in ("megatron.zero.config.ConfigError", "megatron.checkpoint.layout.CheckpointError",
                 "preprocess_data.BadInput", "convert_to_hf.ConversionError", "tasks.zeroshot_gpt.TaskError",
                 "megatron.guards.operations.LossScaleStuckError"):
        assert name in names, name
    assert len(names) >= 28, sorted(names)


def test_every_error_a_user_can_cause_derives_from_user_error(project_errors):
    assert _not_user_errors(project_errors["found"]) == []


def test_the_allow_list_names_internal_errors_only(project_errors):
    """Each allow-listed class exists and is not a UserError (an entry never goes stale or hides a user error)."""
    classes = {c["name"]: c for c in project_errors["found"]}
    for name in INTERNAL_ERRORS:
        assert name in classes and not classes[name]["user_error"], name


def test_user_errors_keep_their_builtin_bases(project_errors):
    """`except ValueError` (the tests', a caller's) still catches what it caught before the base was added."""
    bases = {c["name"]: c["bases"] for c in project_errors["found"]}
    for name, builtin in (("megatron.zero.config.ConfigError", "ValueError"),
                          ("megatron.data.corpora.DataPathError", "FileNotFoundError"),
                          ("megatron.checkpoint.layout.CheckpointError", "RuntimeError"),
                          ("megatron.text_generation.generation.InferenceInputError", "ValueError")):
        assert bases[name][:2] == ["UserError", builtin], (name, bases[name])


def test_a_misspelt_flag_gets_the_nearest_one_suggested(capsys):
    """cli.ArgumentParser (every entry point's): one line, exit 2, the nearest flag for each misspelt one (difflib,
    as for a JSON key), none for a word near nothing; a tool's parser suggests among its own flags."""
    from megatron.arguments import parse_args
    from tests.helpers import parser_error
    import estimate_memory
    line = parser_error(lambda argv: parse_args(args_list=argv), ["--mock-data", "--context-paralel-size", "2"],
                        capsys)
    assert line.endswith("error: unrecognized arguments: --context-paralel-size 2; did you mean "
                         "--context-parallel-size? (see --help)"), line
    line = parser_error(lambda argv: parse_args(args_list=argv), ["--mock-data", "--sed=3", "--qqqqqqqq",
                                                                  "--hiden-size", "8"], capsys)
    assert line.endswith("unrecognized arguments: --sed=3 --qqqqqqqq --hiden-size 8; did you mean --seed (for "
                         "--sed), --hidden-size (for --hiden-size)? (see --help)"), line
    line = parser_error(estimate_memory.build_parser().parse_args, ["--zero-stag", "2"], capsys)
    assert line.endswith("error: unrecognized arguments: --zero-stag 2; did you mean --zero-stage? (see --help)"), line


def test_the_walk_flags_an_error_re_parented_to_exception(tmp_path):
    """A planted module beside the project: its class derived from Exception (or a builtin) alone is flagged; one
    from a project error (through it, UserError) is not."""
    (tmp_path / "planted_tool.py").write_text(textwrap.dedent("""
        from megatron.cli import UserError
        from megatron.zero import ConfigError
        class ForgotTheBase(Exception): pass
        class BuiltinOnly(ValueError): pass
        class Fine(UserError, OSError): pass
        class AlsoFine(ConfigError): pass
    """))
    walked = _walk([("planted_tool", str(tmp_path))])
    assert walked["failed"] == {}
    assert {c["name"] for c in walked["found"]} == {f"planted_tool.{n}" for n in
                                                    ("ForgotTheBase", "BuiltinOnly", "Fine", "AlsoFine")}
    assert _not_user_errors(walked["found"]) == ["planted_tool.BuiltinOnly", "planted_tool.ForgotTheBase"]


def test_run_main_prints_a_user_error_as_one_line_and_keeps_a_bug_s_traceback(tmp_path):
    """run_main(main) alone: any UserError subclass (here one from a tool and one from the library) is `error:
    message`, exit status 1; a plain exception (a bug), a ValueError as a KeyError, keeps its traceback."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from megatron.initialize import run_main
        from megatron.checkpoint.layout import CheckpointError
        from megatron.guards.operations import LossScaleStuckError
        kind = sys.argv[2]
        def main():
            if kind == "checkpoint":
                raise CheckpointError("ckpt/iter_0000010 is damaged: pass --load of another checkpoint")
            if kind == "stuck":
                raise LossScaleStuckError("the loss scale hit its minimum at iteration 7: lower --lr")
            if kind == "value":
                raise ValueError("an internal bug")
            raise KeyError("a bug")
        run_main(main)
    """)
    runs = {kind: warm_python.run([sys.executable, "-c", script, REPO, kind], cwd=str(tmp_path), capture_output=True,
                                  text=True, timeout=120) for kind in ("checkpoint", "stuck", "bug", "value")}
    assert (runs["checkpoint"].returncode, runs["checkpoint"].stderr) == (
        1, "error: ckpt/iter_0000010 is damaged: pass --load of another checkpoint\n")
    assert (runs["stuck"].returncode, runs["stuck"].stderr) == (
        1, "error: the loss scale hit its minimum at iteration 7: lower --lr\n")
    for kind, last_line in (("bug", "KeyError: 'a bug'"), ("value", "ValueError: an internal bug")):
        lines = runs[kind].stderr.strip().splitlines()
        assert runs[kind].returncode == 1 and lines[0] == "Traceback (most recent call last):" and \
            lines[-1] == last_line, runs[kind].stderr
