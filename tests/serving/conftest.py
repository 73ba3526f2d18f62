"""The serving tests' shared pieces: one tiny checkpoint per session (3 ZeRO steps on the embedded data, 64
positions), and one server on it for the session (tools/run_text_generation_server.py as a subprocess, --port 0, waited
for by its `serving NAME at URL` line).

    def test_x(server):                       # the module's tp-1 server: server.url, server.post(path, body)
    with start_server(checkpoint, ["--api-key", "k"]) as other: ...
"""
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import REPO
from tests import warm_python

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64"]
SERVER = os.path.join(REPO, "tools", "run_text_generation_server.py")
START_TIMEOUT = 180


class Checkpoint:
    def __init__(self, path, data):
        self.path = path
        self.tokenizer_args = ["--vocab-file", os.path.join(data, "vocab.json"),
                               "--merge-file", os.path.join(data, "merges.txt")]
        self.model_args = SHAPE + self.tokenizer_args + ["--load", path]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, webtext_data):
    """A ZeRO-path checkpoint of the tiny model (its weights barely trained: the tests compare, not judge)."""
    from tests.helpers import write_config
    root = tmp_path_factory.mktemp("serving_checkpoint")
    save = str(root / "tiny")
    tokenizer = Checkpoint(save, webtext_data).tokenizer_args
    warm_python.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + SHAPE + tokenizer + [
         "--data-path", os.path.join(webtext_data, "webtext_text_document"), "--data-cache-path", str(root / "cache"),
         "--batch-size", "2", "--train-iters", "3", "--lr", "3e-3", "--warmup", "0", "--log-interval", "100",
         "--eval-iters", "0", "--save", save, "--deepspeed", "--deepspeed_config", write_config(str(root))],
         cwd=REPO, check=True, capture_output=True, timeout=300)
    return Checkpoint(save, webtext_data)


class Server:
    """A running server: its base URL and a JSON client (urllib: no dependency on the client under test)."""

    def __init__(self, url, process, api_key=None):
        self.url, self.process, self.api_key = url, process, api_key

    def request(self, method, path, body=None, raw=None, headers=None):
        """(status, decoded JSON answer)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = dict(self._headers(), **(headers or {}))
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, path, body):
        """The JSON chunks of a server-sent-event answer, checked to end with `data: [DONE]`."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers=self._headers())
        with urllib.request.urlopen(request, timeout=120) as response:
            events = [line[len("data: "):] for line in response.read().decode().split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-3:]
        return [json.loads(event) for event in events[:-1]]

    def _headers(self):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def post(self, path, body, **kwargs):
        return self.request("POST", path, body, **kwargs)


def server_command(checkpoint, extra=(), nproc=1):
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return launcher + [SERVER] + checkpoint.model_args + ["--port", "0"] + list(extra)


@contextlib.contextmanager
def start_server(checkpoint, extra=(), nproc=1, api_key=None):
    """The server on `checkpoint` until the block ends (then SIGTERM, as Ctrl-C would)."""
    command = server_command(checkpoint, list(extra) + (["--api-key", api_key] if api_key else []), nproc)
    process = warm_python.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield Server(_wait_for_url(process), process, api_key)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_url(process):
    """The URL of the `serving NAME at URL` line; the output so far when the server dies or never gets there."""
    deadline, lines = time.monotonic() + START_TIMEOUT, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if line.startswith("serving ") and " at http" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()   # never let its pipe fill up
            return line.split(" at ")[-1].strip()
    raise RuntimeError("the server did not start:\n" + "".join(lines[-40:]))


API_KEY = "sesame"


@pytest.fixture(scope="session")
def server(checkpoint):
    """The session's tp-1 server (--api-key API_KEY: Server.request sends it), shared by every module."""
    with start_server(checkpoint, ["--max-batch-size", "8"], api_key=API_KEY) as running:
        yield running
