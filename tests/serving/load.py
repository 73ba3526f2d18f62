"""A bounded loopback load on a running server: many clients, each a thread with its own kept-alive connection,
sending a fixed cycle of good requests (completions and chat, streamed and not), bad ones (each with the status it
must get) and streams dropped after their first event. Standard library only.

    report = run_load(host, port, server_pid, clients=16, requests_per_client=40, api_key="key")
    report.statuses_of("good")     # Counter of HTTP statuses
"""
import collections
import http.client
import json
import threading
import time
from dataclasses import dataclass, field


def _good(body):
    return ("POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions", json.dumps(body))


# (kind, method, path, body or raw bytes, the status it must get, extra headers); the API key is sent, a wrong one
# for "bad-key".
CASES = [
    ("good", *_good({"prompt": "The load test", "max_tokens": 3, "temperature": 0})),
    ("good", *_good({"prompt": [5, 9, 3, 17], "max_tokens": 3, "stream": True, "temperature": 0})),
    ("good", *_good({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})),
    ("good", *_good({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 3, "n": 2})),
    ("good", *_good({"prompt": "What lm-eval asks: the log-probabilities of every token of a longer prompt, "
                               "echoed back with the top five alternatives at each position",
                     "max_tokens": 1, "echo": True, "logprobs": 5, "temperature": 0})),
    ("drop", *_good({"prompt": "A stream read once, then dropped", "max_tokens": 40, "stream": True})),
    ("bad", "POST", "/v1/completions", b'{"prompt": "unclosed', 400),
    ("bad", *_good({"prompt": "x", "max_tokens": 3, "frobnicate": 1}), 400),          # an unknown field
    ("bad", *_good({"prompt": "x", "max_tokens": 100000}), 400),                     # past the context
    ("bad", *_good({"prompt": "", "max_tokens": 3}), 400),                           # an empty prompt
    ("bad", *_good({"prompt": "x", "max_tokens": "three"}), 400),                    # a wrong type
    # Past the 1 MiB body limit, refused from its Content-Length alone (sending 2 MiB bodies at once would add the
    # allocator's steps to the server's RSS).
    ("bad", "POST", "/v1/completions", b'{"prompt": "', 413, {"Content-Length": str(2 << 20)}),
    ("bad-key", *_good({"prompt": "x", "max_tokens": 3}), 401),
    ("bad", "GET", "/v1/nowhere", None, 404),
]


@dataclass
class Outcome:
    kind: str
    status: int
    problem: str = ""        # what was wrong with the answer beyond its status ("" = nothing)


@dataclass
class LoadReport:
    outcomes: list = field(default_factory=list)
    rss_kib: list = field(default_factory=list)      # the server's VmRSS after each completed request, in order
    seconds: float = 0.0

    def statuses_of(self, kind):
        return collections.Counter(o.status for o in self.outcomes if o.kind == kind)

    def problems(self):
        return [o for o in self.outcomes if o.problem]


def server_rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _check_answer(kind, expected, status, payload, streamed):
    """'' when the answer is what the case must get, else what differs."""
    if kind in ("bad", "bad-key"):
        if status != expected:
            return f"status {status}, expected {expected}: {payload[:200]!r}"
        error = json.loads(payload).get("error", {})
        return "" if error.get("message") else f"no OpenAI error message in {payload[:200]!r}"
    if status != 200:
        return f"status {status}: {payload[:200]!r}"
    if streamed:
        events = [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]
        return "" if events and events[-1] == "[DONE]" else f"the stream did not end with [DONE]: {payload[-200:]!r}"
    return "" if json.loads(payload)["choices"] else f"no choices in {payload[:200]!r}"


def _one(connection, case, api_key):
    """Send one case on the connection; returns (Outcome, whether the connection must be reopened)."""
    kind, method, path, body = case[:4]
    expected = case[4] if len(case) > 4 else 200
    headers = {"Content-Type": "application/json", **(case[5] if len(case) > 5 else {})}
    key = "wrong-" + api_key if kind == "bad-key" else api_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    connection.request(method, path, body, headers)
    response = connection.getresponse()
    if kind == "drop":                           # read the first event, then hang up mid-stream
        first = response.read(6)
        ok = response.status == 200 and first == b"data: "
        return Outcome(kind, response.status, "" if ok else f"first line {first!r}"), True
    payload = response.read()
    streamed = response.getheader("content-type", "").startswith("text/event-stream")
    truncated = len(case) > 5                   # the server never reads the rest: this connection is spent
    reopen = truncated or response.getheader("connection", "").lower() == "close"
    return Outcome(kind, response.status, _check_answer(kind, expected, response.status, payload, streamed)), reopen


def run_load(host, port, server_pid, clients, requests_per_client, api_key=None):
    """clients threads x requests_per_client requests, client c starting at case c of CASES; the server's RSS
    read after every answer. A client's exception is a failure of the load, reported in the outcomes."""
    report = LoadReport()
    lock = threading.Lock()

    def client(index):
        connection = http.client.HTTPConnection(host, port, timeout=120)
        for number in range(requests_per_client):
            case = CASES[(index + number) % len(CASES)]
            try:
                outcome, reopen = _one(connection, case, api_key)
            except (OSError, http.client.HTTPException, ValueError) as error:
                outcome, reopen = Outcome(case[0], 0, f"{type(error).__name__}: {error}"), True
            if reopen:
                connection.close()
                connection = http.client.HTTPConnection(host, port, timeout=120)
            with lock:
                report.outcomes.append(outcome)
                report.rss_kib.append(server_rss_kib(server_pid))
        connection.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.seconds = time.perf_counter() - start
    return report
