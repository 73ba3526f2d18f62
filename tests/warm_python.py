"""`python ARGS...` for the tests, started from a warm interpreter: one server per pytest worker imports torch,
torch._dynamo and numpy once and forks each command from there. A fresh interpreter pays ~3 CPU-s for those imports
before its first line (torch 1.9 s; torch._dynamo 1.3 s, which torch.optim imports when an optimizer is built), most
of what a test's short command costs; the suite runs hundreds of them on 2 cores.

    done = run([sys.executable, "pretrain_gpt.py", ...], cwd=REPO, capture_output=True, text=True, timeout=120)
    process = Popen([sys.executable, "-m", "module", ...], stdout=handle, stderr=subprocess.STDOUT, env=env)

`run` and `Popen` take subprocess's arguments for these commands and return what subprocess does
(CompletedProcess; an object with pid, poll, wait, kill, communicate, returncode). The forked command is the
command as a fresh `python` runs it: its own process (pid, exit status, death by a signal), its stdin/stdout/stderr,
environment and working directory; sys.argv and sys.path[0] as Python sets them for a script, `-m` or `-c`; none of
the project's modules imported; an uncaught exception printed by sys.excepthook and exit status 1; atexit handlers
and non-daemon threads finished at exit. What differs: torch was imported under the server's environment (the
suite's: CUDA hidden, OMP_NUM_THREADS=1), so a command that sets torch's own variables, or one that tests an
interpreter without torch, is launched with subprocess. Off the CPU suite (`--device cuda`), and for any other
interpreter than this one, both fall back to subprocess.

`tests/warm_python.sh ARGS...` is the same for what the tests' commands start in turn: the suite's shell scripts
(`PYTHON`) and torchrun's workers (`PYTHON_EXEC`, which torchrun launches its workers with) run it as `python`. It
forwards the signals it gets to the forked command and exits as the command did (by the same signal where one
killed it); the command is killed when it is killed (SIGKILL cannot be forwarded). Where the server cannot run the
command as a fresh interpreter would (other start-up variables, interpreter options other than -u/-B/-m/-c, a
script on stdin), it runs the real interpreter (exec).
"""
import gc
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "torch._dynamo", "numpy")
_server = {}         # pid of this process -> (server process, socket path)
_lock = threading.Lock()


# ---- client ---------------------------------------------------------------------------------------------------
# Read at the interpreter's or torch's start-up: a command whose environment gives them other values than the
# server had is launched with subprocess (PYTHONPATH and PYTHONUNBUFFERED are applied per command).
_STARTUP_VARIABLES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "LD_LIBRARY")
_PER_COMMAND = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHON", "PYTHON_EXEC")
# Not read at start-up: torchrun's variables for its workers (read when the process group or the agent's API runs),
# and Intel OpenMP's, which sklearn's and joblib's imports set (torch's CPU wheel loads GNU OpenMP, libgomp)
_NOT_STARTUP = ("TORCHELASTIC_", "TORCH_NCCL_", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_python.sh")
SOCKET_ENV, REAL_ENV = "MEGATRON_WARM_PYTHON_SOCKET", "MEGATRON_WARM_PYTHON_REAL"
_UNSUPPORTED = ("executable", "preexec_fn", "pass_fds", "shell", "user", "group", "extra_groups", "umask",
                "process_group")
_EXECUTE_CHILD = ("self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, "
                  "shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, "
                  "umask, start_new_session, process_group")


def _startup_environment(env):
    return {key: value for key, value in env.items()
            if key.startswith(_STARTUP_VARIABLES) and key not in _PER_COMMAND and not key.startswith(_NOT_STARTUP)}


def shim_environment():
    """The variables that make the suite's scripts and torchrun's workers start `python` through the warm server
    (tests/conftest.py sets them on the CPU suite); {} where commands are not forked (MEGATRON_WARM_PYTHON=0)."""
    if os.environ.get("MEGATRON_TEST_DEVICE", "cpu") != "cpu" or os.environ.get("MEGATRON_WARM_PYTHON") == "0":
        return {}
    return {"PYTHON": SHIM, "PYTHON_EXEC": SHIM, REAL_ENV: sys.executable}


def start_for_scripts():
    """Start this worker's server (if the shim is on), so that a script launched next finds it (SOCKET_ENV)."""
    if os.environ.get("PYTHON_EXEC") == SHIM and _enabled([sys.executable, "-c", ""], {}):
        _socket_path()


def _enabled(args, kwargs):
    """Whether this command can be forked by the server (else subprocess runs it)."""
    import inspect
    env = kwargs.get("env")
    return (os.environ.get("MEGATRON_TEST_DEVICE", "cpu") == "cpu" and os.environ.get("MEGATRON_WARM_PYTHON") != "0"
            and isinstance(args, (list, tuple)) and len(args) > 1 and args[0] == sys.executable
            and not any(kwargs.get(name) for name in _UNSUPPORTED) and kwargs.get("close_fds", True)
            and (env is None or _startup_environment(env) == _startup_environment(os.environ))
            and str(inspect.signature(subprocess.Popen._execute_child)) == f"({_EXECUTE_CHILD})")


def _socket_path():
    with _lock:
        entry = _server.get(os.getpid())
        if entry is None or entry[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="warm-python-"), "socket")
            env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
            process = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdin=subprocess.DEVNULL,
                                       env=env)
            deadline = time.monotonic() + 120
            while not os.path.exists(path + ".ready"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the warm python server did not start (exit {process.poll()})")
                time.sleep(0.02)
            entry = _server[os.getpid()] = (process, path)
            os.environ[SOCKET_ENV] = path     # for the scripts and torchrun workers this worker starts (the shim)
        return entry[1]


def _send(connection, obj):
    data = pickle.dumps(obj)
    connection.sendall(struct.pack("!I", len(data)) + data)


def _receive(connection):
    header = _read_exactly(connection, 4)
    return None if header is None else pickle.loads(_read_exactly(connection, struct.unpack("!I", header)[0]))


def _read_exactly(connection, size):
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class _Warm(subprocess.Popen):
    """subprocess.Popen whose process the warm server forks: subprocess's own pipes, communicate() and timeouts;
    the server reaps the child and sends its exit status (a negative signal number where a signal killed it)."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                       uid, umask, start_new_session, process_group):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(_socket_path())
            request = {"argv": [os.fspath(arg) for arg in args[1:]], "cwd": os.fspath(cwd or os.getcwd()),
                       "env": dict(os.environ if env is None else env), "new_session": bool(start_new_session)}
            fds = [fd if fd != -1 else inherited for fd, inherited in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
            socket.send_fds(connection, [pickle.dumps(request)], fds)
            reply = _receive(connection)
            if reply is None:
                raise OSError("the warm python server closed the connection")
        except BaseException:
            connection.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self.pid, self._connection = reply["pid"], connection

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):    # noqa: N803
        if self.returncode is None:
            self._connection.setblocking(False)
            try:
                self._status(_receive(self._connection))
            except BlockingIOError:
                self._connection.setblocking(True)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self._status(_receive(self._connection))
            except socket.timeout:
                self._connection.settimeout(None)
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _status(self, reply):
        self.returncode = reply["returncode"] if reply else -9     # no reply: the server died, and the child with it
        self._connection.close()

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)


def Popen(args, **kwargs):     # noqa: N802 (subprocess's name)
    """subprocess.Popen(args, **kwargs), forked by the warm server where it can be."""
    return (_Warm if _enabled(args, kwargs) else subprocess.Popen)(args, **kwargs)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):   # noqa: A002
    """subprocess.run(args, ...), forked by the warm server where it can be."""
    if not _enabled(args, kwargs):
        return subprocess.run(args, input=input, capture_output=capture_output, timeout=timeout, check=check,
                              **kwargs)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with _Warm(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(args, timeout, expired.output, expired.stderr) from None
    done = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


# ---- server ---------------------------------------------------------------------------------------------------
def _serve(path):
    gc.disable()                             # as megatron/spawn/preload.py: no full collections while importing,
    for name in PRELOAD:                     # and none ever again over what the commands inherit
        __import__(name)
    gc.freeze()
    gc.enable()
    del sys.path[0]                          # this file's directory: each command gets its own sys.path[0]
    base_path = list(sys.path)
    children = {}                            # pid -> the client's connection, which gets the exit status

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    _send(connection, {"returncode": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                connection.close()

    signal.signal(signal.SIGCHLD, reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(5)
    open(path + ".ready", "w").close()
    try:
        _accept_until_orphaned(listener, children, base_path, path)
    finally:
        for name in (path, path + ".ready"):
            os.unlink(name)
        os.rmdir(os.path.dirname(path))


def _accept_until_orphaned(listener, children, base_path, path):
    """Fork a child for each request until the pytest worker that started this server is gone."""
    parent, startup = os.getppid(), _startup_environment(os.environ)
    while os.getppid() == parent:
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        connection.settimeout(None)
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        request = pickle.loads(message)
        if request.get("shim") and _as_imported(_startup_environment(request["env"]), startup) != startup:
            for fd in fds:
                os.close(fd)
            _send(connection, {"fallback": True})      # the shim execs the real interpreter
            connection.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})    # registered before its exit can be reaped
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            listener.close()
            if request.get("shim"):
                _die_with_the_shim(connection)
            else:
                connection.close()
            _child(dict(request, env={**request["env"], SOCKET_ENV: path}), fds, base_path)   # never returns
        for fd in fds:
            os.close(fd)
        children[pid] = connection
        _send(connection, {"pid": pid})
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _as_imported(variables, server):
    """torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR to its default: a command without it would too."""
    inductor = "TORCHINDUCTOR_CACHE_DIR"
    return {inductor: server[inductor], **variables} if inductor in server else variables


def _die_with_the_shim(connection):
    """The shim's end closes when it exits: killed (SIGKILL, which it cannot forward), so is the command."""
    def watch():
        try:
            while connection.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="warm-python-shim-watch", daemon=True).start()


def _child(request, fds, base_path):
    status = 1
    try:
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        status = _run_command(request["argv"], extra + base_path, bool(os.environ.get("PYTHONUNBUFFERED")))
    except BaseException:    # noqa: B036 (the server's own failure to start the command: shown, exit 1)
        import traceback
        traceback.print_exc()
    os._exit(status)


def _run_command(argv, path, unbuffered):
    """Run `python *argv` in this process as the interpreter would (a new __main__ module); its exit status."""
    import atexit
    import io
    import runpy
    import types
    while argv[0] in ("-u", "-B"):
        unbuffered |= argv[0] == "-u"
        argv = argv[1:]
    if unbuffered:                           # as `python -u`: text layer straight onto the unbuffered file
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[:] = ["-m"] + argv[2:], [os.getcwd()] + path
            runpy._run_module_as_main(argv[1], alter_argv=True)      # what `python -m` calls
        else:
            main = types.ModuleType("__main__")
            if argv[0] == "-c":
                sys.argv, sys.path[:] = ["-c"] + argv[2:], [""] + path
                source, filename = argv[1], "<string>"
            else:
                filename = os.path.abspath(argv[0])
                sys.argv, sys.path[:] = list(argv), [os.path.dirname(filename)] + path
                main.__file__ = filename
                with open(filename, "rb") as handle:
                    source = handle.read()
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(source, filename, "exec"), main.__dict__)
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException as error:    # noqa: B036 (uncaught: the interpreter prints it, without this frame)
        error.with_traceback(error.__traceback__.tb_next)
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
    import threading as threading_module
    threading_module._shutdown()             # the interpreter's exit: join non-daemon threads, then atexit, flush
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def _exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---- the shim (tests/warm_python.sh) ---------------------------------------------------------------------------
_SHIM_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _forkable(argv):
    """Whether the server runs `python *argv` as the interpreter would (else the real interpreter does)."""
    while argv and argv[0] in ("-u", "-B"):
        argv = argv[1:]
    if not argv or argv[0] == "-":
        return False
    return len(argv) > 1 if argv[0] in ("-m", "-c") else not argv[0].startswith("-")


def _shim(argv):
    real = os.environ.get(REAL_ENV)
    path = os.environ.get(SOCKET_ENV)
    reply = None
    signal.pthread_sigmask(signal.SIG_BLOCK, _SHIM_SIGNALS)     # held until they can be forwarded (below)
    if path and _forkable(argv):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(path)
            request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "new_session": False, "shim": True}
            socket.send_fds(connection, [pickle.dumps(request)], [0, 1, 2])
            reply = _receive(connection)
        except OSError:
            reply = None
    if not reply or reply.get("fallback"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SHIM_SIGNALS)
        os.execv(real, [real] + argv)
    pid = reply["pid"]

    def forward(number, _frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass
    for number in _SHIM_SIGNALS:
        signal.signal(number, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SHIM_SIGNALS)   # one that came while the command started: now
    status = _receive(connection)
    code = status["returncode"] if status else -signal.SIGKILL
    if code < 0:                             # die as the command died
        if -code != signal.SIGKILL and -code != signal.SIGSTOP:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--shim":
        _shim(sys.argv[2:])
    _serve(sys.argv[1])
