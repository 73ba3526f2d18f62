"""Bad input never takes the server down: each case gets its HTTP status and an OpenAI error object naming the
problem (the session's server, which has an API key; after every case it still answers); a client that drops a
stream frees the model; a bad start (missing checkpoint, another model's checkpoint, a taken port) is one line."""
import http.client
import json
import socket
import threading
import time
import urllib.parse

import pytest

from tests.helpers import REPO
from tests.serving.conftest import API_KEY as KEY
from tests.serving.conftest import server_command
from tests import warm_python
GOOD = {"prompt": "The game", "max_tokens": 4, "temperature": 0}
CASES = [   # (what, raw body or JSON, status, the param named, a phrase of the message)
    ("malformed JSON", b'{"prompt": "x", ', 400, None, "not valid JSON"),
    ("unknown field", dict(GOOD, temprature=0), 400, "temprature", "unknown field 'temprature'"),
    ("past the context", dict(GOOD, max_tokens=62), 400, "max_tokens", "past the model's context of 64"),
    ("empty prompt", dict(GOOD, prompt=""), 400, "prompt", "empty"),
    ("empty prompt list", dict(GOOD, prompt=[]), 400, "prompt", "empty"),
    ("wrong type", dict(GOOD, max_tokens="4"), 400, "max_tokens", "expected an integer"),
    ("bool is not an int", dict(GOOD, n=True), 400, "n", "expected an integer"),
    ("id outside the vocabulary", dict(GOOD, prompt=[5, 8192]), 400, "prompt", "outside the vocabulary"),
    ("unsupported field", dict(GOOD, best_of=3), 400, "best_of", "not supported"),
    ("body not an object", [1, 2], 400, None, "JSON object"),
    ("another model", dict(GOOD, model="gpt-4"), 404, "model", "not served here"),
]


@pytest.fixture
def keyed(server):
    return server


@pytest.mark.parametrize("what, body, status, param, phrase", CASES, ids=[case[0] for case in CASES])
def test_bad_request_gets_its_status_and_error(keyed, what, body, status, param, phrase):
    raw = body if isinstance(body, bytes) else None
    got, answer = keyed.post("/v1/completions", None if raw else body, raw=raw)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and phrase in answer["error"]["message"], answer
    assert keyed.post("/v1/completions", GOOD)[0] == 200                       # still serving


def test_too_large_body_refused_before_it_is_read(keyed):
    """Content-Length one byte past the 1 MiB limit: 413 from the headers alone (the body is never sent)."""
    url = urllib.parse.urlparse(keyed.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                        "Content-Length": str((1 << 20) + 1)}.items():
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 413 and "larger than 1048576 bytes" in answer["error"]["message"], answer
    exactly = b'{"prompt": "The", "max_tokens": 1, "user": "' + b"a" * ((1 << 20) - 46) + b'"}'
    assert len(exactly) == 1 << 20 and keyed.post("/v1/completions", None, raw=exactly)[0] == 200   # at the limit


def test_megatron_api_refuses_by_name(keyed):
    for body, param in [({"prompts": ["x"], "beam_width": 2}, "beam_width"),
                        ({"prompts": ["x"], "top_k": 5, "top_p": 0.5}, "top_p"),
                        ({"prompts": ["x"], "prevent_newline_after_colon": True}, "prevent_newline_after_colon"),
                        ({"prompts": ["x"], "all_probs": True}, "all_probs"),
                        ({"prompts": ["x"], "tokens_to_generate": 0}, "tokens_to_generate"),
                        ({"prompts": "x"}, "prompts")]:
        status, answer = keyed.request("PUT", "/api", body)
        assert (status, answer["error"]["param"]) == (400, param), answer


def test_chat_messages_checked(keyed):
    for messages in ([], [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                     [{"role": "robot", "content": "Hi"}]):
        status, answer = keyed.post("/v1/chat/completions", {"messages": messages})
        assert (status, answer["error"]["param"]) == (400, "messages"), answer


def test_wrong_or_missing_api_key(keyed):
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, answer = keyed.post("/v1/completions", GOOD, headers=headers)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
    assert keyed.request("GET", "/health", headers={"Authorization": ""})[0] == 200   # health needs no key


def test_dropped_stream_frees_its_place(keyed):
    """While a long request (64 sampled rows: 8 batches) holds the model, a stream queued behind it is dropped by
    its client after the headers: it never runs (batches = the long request's 8 + the next request's 1)."""
    before = keyed.request("GET", "/health")[1]["batches"]
    long = threading.Thread(target=keyed.post, args=("/v1/completions", dict(GOOD, max_tokens=60, n=64,
                                                                             temperature=1.0)))
    long.start()
    while keyed.request("GET", "/health")[1]["running_rows"] == 0:
        time.sleep(0.01)
    url = urllib.parse.urlparse(keyed.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(dict(GOOD, max_tokens=60, stream=True)),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert connection.getresponse().status == 200
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    long.join()
    assert keyed.post("/v1/completions", GOOD)[0] == 200
    after = keyed.request("GET", "/health")[1]
    assert after["batches"] - before == 8 + 1, (before, after)


def test_dropped_running_stream_stops(keyed):
    """A stream of 64 sampled rows (8 batches of 8) whose client hangs up after its first chunk: the batches after
    the hang-up are never run."""
    before = keyed.request("GET", "/health")[1]["batches"]
    url = urllib.parse.urlparse(keyed.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(dict(GOOD, max_tokens=60, n=64, temperature=1.0,
                                                                  stream=True)),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert keyed.post("/v1/completions", GOOD)[0] == 200          # queued behind what is left of the stream
    assert keyed.request("GET", "/health")[1]["batches"] - before < 8 + 1


@pytest.mark.parametrize("change, phrase", [
    (["--load", "/nonexistent/ckpt"], "holds no checkpoint"),
    (["--hidden-size", "48", "--num-attention-heads", "4"], "hidden"),
], ids=["missing", "another model"])
def test_bad_start_is_one_line(checkpoint, change, phrase):
    command = server_command(checkpoint) + change
    result = warm_python.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and phrase in errors[0], result.stderr[-2000:]


def test_taken_port_is_one_line(checkpoint):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        command = server_command(checkpoint) + ["--port", str(other.getsockname()[1])]
        result = warm_python.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(errors) == 1 and "cannot listen on" in errors[0], result.stderr[-2000:]


def test_pipeline_refused_by_name(checkpoint):
    """Two pipeline stages (torchrun, 2 processes): refused before serving, the flag and the fix named."""
    command = server_command(checkpoint, ["--pipeline-model-parallel-size", "2"], nproc=2)
    result = warm_python.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors, result.stderr[-2000:]
    assert all("not --pipeline-model-parallel-size 2" in line for line in errors), errors
    assert "serving " not in result.stdout


def test_listening_socket_is_tcp_so_responses_are_not_delayed():
    """The socket bound before uvicorn starts says IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on sockets whose protocol is TCP; with protocol 0 each kept-alive response waited ~45 ms."""
    from run_text_generation_server import listening_socket
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        client = socket.create_connection(sock.getsockname()[:2])
        accepted, _ = sock.accept()
        with client, accepted:
            assert accepted.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
