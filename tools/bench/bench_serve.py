"""What serving costs: requests/s and tokens/s of tools/run_text_generation_server.py (POST /v1/completions over
loopback HTTP) at 1, 4 and 16 concurrent clients, against calling `generate` in process on the same checkpoint and
against Hugging Face transformers' generate on its export (tools/convert_to_hf.py). Greedy, one server process.

    python tools/bench/bench_serve.py                     # CPU: trains a tiny checkpoint (L4 h256, webtext vocab)
    python tools/bench/bench_serve.py --connection-per-request --clients 1 --requests 16 --repeats 5
    python tools/bench/bench_serve.py --device cuda --layers 12 --hidden 768 --heads 12 --seq-length 1024

Each client is a thread with its own kept-alive connection (or a new one per request: --connection-per-request)
sending --requests requests one after another, each a prompt of --prompt-tokens token ids (distinct per request)
and max_tokens --max-tokens at temperature 0; tokens/s counts the completion tokens the responses' usage reports. "In process" is the same work without HTTP: for c
clients, generate() on batches of c of the same prompts, --requests times (the batch the server forms at best);
"HF" is GPT2LMHeadModel.generate on the same batches (the prompts all have one length: no padding on either side).
Serving overhead = 1 - server requests/s / in-process requests/s; the goal at 1 client is <= 5%.
The three ways alternate within each repeat (this machine is shared and noisy); figures are medians of --repeats.
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
DATA = os.path.join(REPO, "data", "webtext")
TOKENIZER = ["--vocab-file", os.path.join(DATA, "vocab.json"), "--merge-file", os.path.join(DATA, "merges.txt")]


def model_flags(options):
    return ["--num-layers", str(options.layers), "--hidden-size", str(options.hidden), "--num-attention-heads",
            str(options.heads), "--seq-length", str(options.seq_length), "--max-position-embeddings",
            str(options.seq_length), *TOKENIZER]


def run(command, env=None):
    """Run a project command; its output only when it fails."""
    from megatron.spawn import free_port
    env = dict(os.environ, MASTER_PORT=str(free_port()), **(env or {}))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:2])} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def make_checkpoint(options, directory):
    """A checkpoint of the benchmark's shape: two iterations of pretrain_gpt.py on the default data."""
    save = os.path.join(directory, "ckpt")
    run([sys.executable, "pretrain_gpt.py", *model_flags(options), "--data-path",
         os.path.join(DATA, "webtext_text_document"), "--data-cache-path", os.path.join(directory, "cache"),
         "--batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--log-interval", "100", "--eval-iters", "0",
         "--save", save])
    return save


class Server:
    """tools/run_text_generation_server.py on a free port, started and stopped with the with-block."""

    def __init__(self, options, load):
        self.command = [sys.executable, "tools/run_text_generation_server.py", *model_flags(options), "--load", load,
                        "--port", "0", "--max-batch-size", str(max(options.clients))]

    def __enter__(self):
        self.process = subprocess.Popen(self.command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        seen = []
        for line in self.process.stdout:
            seen.append(line)
            if line.startswith("serving "):
                self.host, self.port = line.rsplit("http://", 1)[1].strip().rstrip("/").rsplit(":", 1)
                threading.Thread(target=self.process.stdout.read, daemon=True).start()   # keep the pipe drained
                return self
        raise SystemExit("the server did not start:\n" + "".join(seen[-30:]))

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=30)


def post_completions(connection, prompt, max_tokens):
    """One greedy /v1/completions request on a kept-alive connection: the number of completion tokens."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = json.loads(response.read())
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {payload}")
    return payload["usage"]["completion_tokens"]


def bench_server(server, prompts, requests, max_tokens, per_request=False):
    """(requests/s, tokens/s) with len(prompts[0]) clients, client c sending prompts[r][c] for r < requests; on
    one kept-alive connection per client, or a new connection per request (`per_request`)."""
    clients = len(prompts[0])
    tokens = [0] * clients
    start_together = threading.Barrier(clients + 1)

    def client(index):
        connect = lambda: http.client.HTTPConnection(server.host, int(server.port), timeout=600)   # noqa: E731
        connection = connect()
        start_together.wait()
        for rows in prompts[:requests]:
            if per_request:
                connection.close()
                connection = connect()
            tokens[index] += post_completions(connection, rows[index], max_tokens)
        connection.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    start_together.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    return clients * requests / seconds, sum(tokens) / seconds


def bench_in_process(model, prompts, requests, max_tokens, eod_id):
    """(requests/s, tokens/s) of generate() on the same batches, one after another."""
    from megatron.text_generation import generate
    tokens = 0
    start = time.perf_counter()
    for rows in prompts[:requests]:
        tokens += sum(len(out) for out in generate(model, rows, max_tokens, greedy=True, eod_id=eod_id))
    synchronize()
    seconds = time.perf_counter() - start
    return len(prompts[0]) * requests / seconds, tokens / seconds


def bench_hf(hf, prompts, requests, max_tokens, eod_id):
    """(requests/s, tokens/s) of GPT2LMHeadModel.generate on the same batches (stopping at eod_id, as ours)."""
    import torch
    device = next(hf.parameters()).device
    tokens = 0
    start = time.perf_counter()
    with torch.no_grad():
        for rows in prompts[:requests]:
            ids = torch.tensor(rows, device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              eos_token_id=eod_id, pad_token_id=eod_id)[:, ids.size(1):]
            tokens += sum(len(row) if eod_id not in row else row.index(eod_id) + 1 for row in out.tolist())
    synchronize()
    seconds = time.perf_counter() - start
    return len(rows) * requests / seconds, tokens / seconds


def synchronize():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_in_process(options, load):
    """Our model from the checkpoint, as the server loads it (load_inference_model), and the tokenizer's eod id."""
    from megatron.global_vars import get_tokenizer
    from megatron.initialize import initialize_megatron
    from megatron.spawn import free_port
    from megatron.text_generation import load_inference_model
    os.environ["MASTER_PORT"] = str(free_port())         # this process's own one-rank group
    args = initialize_megatron(args_list=[*model_flags(options), "--load", load, "--data-path",
                                          os.path.join(DATA, "webtext_text_document")])
    return load_inference_model(args, "bench_serve", need_tokenizer=True), get_tokenizer().eod


def load_hf(load, directory, device):
    from transformers import GPT2LMHeadModel
    export = os.path.join(directory, "hf")
    run([sys.executable, "tools/convert_to_hf.py", "--load", load, "--output", export, *TOKENIZER])
    return GPT2LMHeadModel.from_pretrained(export).to(device).eval()


def prompt_table(options, vocab):
    """prompts[r][c]: the r-th request's prompt of client c (distinct token ids, one length)."""
    import torch
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (options.requests, max(options.clients), options.prompt_tokens),
                        generator=generator)
    return ids.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", help="a checkpoint of the model flags' shape (default: train one for 2 iterations)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--connection-per-request", action="store_true",
                        help="open a new connection for each request instead of keeping one alive per client")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of this process and the server's (OMP_NUM_THREADS; 0: torch's "
                             "default). The server decodes on a thread of its own, where torch's default thread "
                             "team ran ~10x faster than on a main thread on this loaded 2-core machine: equal "
                             "thread counts keep the comparison fair")
    options = parser.parse_args()
    if options.threads:
        os.environ["OMP_NUM_THREADS"] = str(options.threads)   # read when torch starts, here and in the server
    if options.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""          # the server process and this one both on the CPU
    import torch
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as directory:
        load = options.load or make_checkpoint(options, directory)
        model, eod_id = load_in_process(options, load)
        hf = load_hf(load, directory, options.device)
        prompts = prompt_table(options, model.config.real_vocab_size or model.config.vocab_size)
        print(f"# GPT-2 L={options.layers} h={options.hidden} heads={options.heads} V={hf.config.vocab_size} on "
              f"{options.device}, prompt {options.prompt_tokens} tokens, "
              f"max_tokens {options.max_tokens}, greedy, {options.requests} requests per client "
              f"({'a connection per request' if options.connection_per_request else 'kept-alive connections'}), "
              f"{options.threads or 'default'} intra-op threads per process, medians of {options.repeats} repeats")
        print("| clients | server req/s | server tok/s | in-process req/s | in-process tok/s | serving overhead | "
              "HF req/s | HF tok/s | server / HF |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        with Server(options, load) as server:
            for clients in options.clients:
                table = [rows[:clients] for rows in prompts]
                ways = {"server": lambda n: bench_server(server, table, n, options.max_tokens,
                                                         options.connection_per_request),
                        "ours": lambda n: bench_in_process(model, table, n, options.max_tokens, eod_id),
                        "hf": lambda n: bench_hf(hf, table, n, options.max_tokens, eod_id)}
                for way in ways.values():
                    way(1)                                              # warm-up (graphs, caches, connections)
                results = {name: [] for name in ways}
                for repeat in range(options.repeats):
                    for name in (list(ways) if repeat % 2 == 0 else list(reversed(ways))):
                        results[name].append(ways[name](options.requests))
                print(row(clients, results), flush=True)


def row(clients, results):
    """One table row from {way: [(requests/s, tokens/s) per repeat]}: medians, overhead, ratio."""
    def median(name, column):
        return statistics.median(pair[column] for pair in results[name])
    server, ours, theirs = (median(n, 0) for n in ("server", "ours", "hf"))
    return (f"| {clients} | {server:,.1f} | {median('server', 1):,.0f} | {ours:,.1f} | {median('ours', 1):,.0f} | "
            f"{1 - server / ours:+.1%} | {theirs:,.1f} | {median('hf', 1):,.0f} | {server / theirs:.2f}x |")


if __name__ == "__main__":
    main()
