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
