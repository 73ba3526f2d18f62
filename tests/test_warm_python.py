"""tests/warm_python.py, the warm interpreter the tests' short commands are forked from: each command gives what a
fresh `python` gives (subprocess.run of the same command is the reference), except that torch is already imported."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import warm_python

PY = sys.executable
THREAD = ("import threading, time\ndef late(): time.sleep(0.3); print('thread done')\n"
          "threading.Thread(target=late).start()")
COMMANDS = {
    "exit status and argv": ([PY, "-c", "import sys; print(sys.argv, repr(sys.path[0])); sys.exit(3)", "a", "b"], {}),
    "exit with a message": ([PY, "-c", "import sys; sys.exit('bye')"], {}),
    "uncaught exception": ([PY, "-c", "def f():\n    raise ValueError('x')\nf()"], {}),
    "module": ([PY, "-m", "json.tool", "--sort-keys"], {"input": '{"b": 1, "a": 2}'}),
    "module's argv and path": ([PY, "-m", "tests.fixtures.print_argv", "x"], {"cwd": os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))}),
    "script's argv and path": ([PY, os.path.join("fixtures", "print_argv.py"), "y"], {"cwd": os.path.dirname(
        os.path.abspath(__file__))}),
    "cwd, environment, PYTHONPATH": ([PY, "-c", "import os, sys; print(os.getcwd(), os.environ['FOO'], "
                                      "sys.path[1])"], {"cwd": "/", "env": dict(os.environ, FOO="1",
                                                                              PYTHONPATH="/nowhere")}),
    "stderr into stdout, in order": ([PY, "-u", "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                                      "print('out2')"], {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}),
    "unbuffered (-u) output survives os._exit": ([PY, "-u", "-c", "import os; print('kept'); os._exit(4)"], {}),
    "buffered output is lost by os._exit": ([PY, "-c", "import os; print('lost'); os._exit(5)"], {}),
    "killed by a signal": ([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {}),
    "non-daemon threads finish, then atexit": ([PY, "-c", THREAD + "\nimport atexit; atexit.register(print, "
                                                "'atexit')"], {}),
    "stdin": ([PY, "-c", "import sys; print(sys.stdin.read().upper())"], {"input": "hello"}),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_gives_what_a_fresh_interpreter_gives(name):
    args, kwargs = COMMANDS[name]
    kwargs = {"capture_output": "stdout" not in kwargs, "text": True, "timeout": 60, **kwargs}
    expected = subprocess.run(args, **kwargs)
    got = warm_python.run(args, **kwargs)
    assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr)


FRESH = "import sys; print('torch' in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in " \
        "('megatron', 'mpu', 'tests')))"


def test_torch_is_imported_and_nothing_of_the_project():
    assert warm_python.run([PY, "-c", FRESH], capture_output=True, text=True).stdout == "True []\n"
    assert subprocess.run([PY, "-c", FRESH], capture_output=True, text=True).stdout == "False []\n"


def test_a_command_inherits_torch_frozen_with_the_collector_on():
    """The server imports with the garbage collector off and freezes what it imported: a command's collections
    skip those objects (and so never copy their pages); a command that left the collector off would leak."""
    state = "import gc; print(gc.isenabled(), gc.get_freeze_count())"
    enabled, frozen = warm_python.run([PY, "-c", state], capture_output=True, text=True).stdout.split()
    assert enabled == "True" and int(frozen) > 100_000, (enabled, frozen)


@pytest.mark.parametrize("override", [{"OMP_NUM_THREADS": "2"}, {"PYTHONHASHSEED": "1"}, {"TORCH_LOGS": "+dynamo"}])
def test_a_command_setting_start_up_variables_gets_a_fresh_interpreter(override):
    """torch and the interpreter read these when they start: the warm server read the suite's values."""
    done = warm_python.run([PY, "-c", FRESH], capture_output=True, text=True, env=dict(os.environ, **override))
    assert done.stdout == "False []\n"


def test_timeout_kills_the_command():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([PY, "-c", "import time; time.sleep(60)"], capture_output=True, timeout=1)
    assert time.monotonic() - started < 30


def test_popen_polls_signals_and_waits():
    process = warm_python.Popen([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n" and process.poll() is None
    os.kill(process.pid, 0)                      # its pid is the command's own
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    process.stdout.close()


# ---- tests/warm_python.sh: `python` for the scripts (PYTHON) and torchrun's workers (PYTHON_EXEC) --------------
SHIM = warm_python.SHIM


@pytest.fixture
def shim_env(monkeypatch):
    """The suite's shim variables and this worker's server (as tests/conftest.py and script_env give them)."""
    for key, value in warm_python.shim_environment().items():
        monkeypatch.setenv(key, value)
    warm_python.start_for_scripts()
    return dict(os.environ)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_shim_gives_what_a_fresh_interpreter_gives(name, shim_env):
    args, kwargs = COMMANDS[name]
    kwargs = {"capture_output": "stdout" not in kwargs, "text": True, "timeout": 60, **kwargs}
    if "env" in kwargs:
        kwargs["env"] = {**shim_env, **{k: v for k, v in kwargs["env"].items() if k in ("FOO", "PYTHONPATH")}}
    expected = subprocess.run(args, **kwargs)
    got = subprocess.run([SHIM] + args[1:], **kwargs)
    assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr)


@pytest.mark.parametrize("how, warm", [([], True), (["-u"], True), (["-X", "utf8"], False), (["-"], False),
                                       ({"TORCH_LOGS": "+dynamo"}, False)],
                         ids=["forked", "-u forked", "-X: real python", "stdin script: real python",
                              "start-up variable: real python"])
def test_the_shim_forks_what_it_can_and_execs_the_rest(how, warm, shim_env):
    env = dict(shim_env, **how) if isinstance(how, dict) else shim_env
    flags = how if isinstance(how, list) else []
    if flags == ["-"]:
        done = subprocess.run([SHIM, "-"], input=FRESH, capture_output=True, text=True, env=env, timeout=60)
    else:
        done = subprocess.run([SHIM, *flags, "-c", FRESH], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout == f"{warm} []\n", done.stderr


@pytest.mark.parametrize("handled", [True, False], ids=["the command handles it", "the command dies by it"])
def test_the_shim_forwards_a_signal_to_the_command(shim_env, handled):
    """torchrun stops its workers with SIGTERM to their process group (start_new_session): the shim's. The command
    gets the signal (its handler runs) and the shim exits as the command did."""
    handler = ("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: (print('got SIGTERM', flush=True), "
               "sys.exit(7)))\n") if handled else ""
    process = subprocess.Popen([SHIM, "-c", handler + "import time; print('up', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline() == "up\n"
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == (7 if handled else -signal.SIGTERM)
    assert process.stdout.read() == ("got SIGTERM\n" if handled else "")
    process.stdout.close()


def test_killing_the_shim_kills_the_command(shim_env, tmp_path):
    pid_file = tmp_path / "pid"
    process = subprocess.Popen([SHIM, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
                                "; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"
    command = int(pid_file.read_text())
    assert command != process.pid
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(command, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command (pid {command}) outlived its shim")
    process.stdout.close()


def test_torchrun_starts_its_workers_through_the_shim(shim_env, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(f"import os\n{FRESH}\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    done = warm_python.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
                           capture_output=True, text=True, env=shim_env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.splitlines()) == ["0 2", "1 2", "True []", "True []"]
