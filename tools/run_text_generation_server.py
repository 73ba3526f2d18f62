"""Serve a checkpoint over HTTP (Megatron-LM's tools/run_text_generation_server.py, with an OpenAI-compatible API):
a checkpoint of either path (Megatron or --deepspeed), any saving topology, loaded weights-only.

    python tools/run_text_generation_server.py <model flags> --vocab-file V --merge-file M --load CKPT \\
        --port 5000 [--host 127.0.0.1] [--api-key KEY] [--max-batch-size 8]
    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --tensor-model-parallel-size 2 ...   # rank 0
        serves HTTP, the other ranks follow each batch by broadcast

When ready it prints one line `serving NAME at http://HOST:PORT` (--port 0 picks a free port, named there).
Endpoints (megatron/serving/app.py): POST /v1/completions, POST /v1/chat/completions, GET /v1/models, PUT /api
(Megatron's), GET /health, GET /tokenizer_info + POST /tokenize + POST /detokenize (vLLM's, what lm-eval's
local-completions tokenizes with), GET / (the chat page). The model flags must match the checkpoint; one
pipeline stage (a pipelined checkpoint loads at --pipeline-model-parallel-size 1).
"""
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import mpu  # noqa: E402
from megatron.cli import UserError  # noqa: E402
from megatron.global_vars import get_tokenizer  # noqa: E402
from megatron.initialize import initialize_megatron, run_main  # noqa: E402
from megatron.posttrain import DEFAULT_TEMPLATE, TEMPLATES  # noqa: E402
from megatron.text_generation import InferenceInputError, load_inference_model  # noqa: E402


class ServerError(UserError, OSError):
    """The server cannot start (the port is taken, the address is wrong): one line."""


def add_server_args(parser):
    group = parser.add_argument_group("text generation server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=5000, help="port to listen on (0: a free one, printed)")
    group.add_argument("--api-key", default=None,
                       help="require the header 'Authorization: Bearer KEY' on every API request (as vLLM)")
    group.add_argument("--max-batch-size", type=int, default=8,
                       help="most rows (prompts x n) decoded together in one batch")
    group.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: the --load directory's name)")
    group.add_argument("--chat-template", choices=sorted(TEMPLATES), default=DEFAULT_TEMPLATE,
                       help="how /v1/chat/completions turns messages into a prompt: finetune_gpt.py's format")
    parser.set_defaults(data_path=["(text generation server: no data)"])   # the training parser wants data
    return parser


def listening_socket(host, port):
    """A bound, listening TCP socket (connections wait in its backlog until the server accepts them)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP; with 0 each
        # kept-alive response waited ~45 ms for the client's delayed ACK (Nagle; Kludex/uvicorn#3149)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock
    except OSError as error:
        raise ServerError(f"cannot listen on {host}:{port} ({error.strerror or error}): pick another --port "
                          "(0: any free one) or --host") from None


def serve(runner, args, sock):
    """Model-parallel rank 0: the HTTP server on `sock` until interrupted (Ctrl-C, SIGTERM)."""
    import uvicorn
    from megatron.serving import create_app
    app = create_app(runner, api_key=args.api_key, max_batch_size=args.max_batch_size,
                     model_name=args.served_model_name, chat_template=args.chat_template)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"serving {args.served_model_name or runner.name} at http://{host}:{port}", flush=True)
    server.run(sockets=[sock])


def main(args_list=None):
    from megatron.checkpoint import get_checkpoint_iteration
    from megatron.serving import ModelRunner
    args = initialize_megatron(extra_args_provider=add_server_args, args_list=args_list)
    if args.max_batch_size < 1:
        raise InferenceInputError(f"--max-batch-size is {args.max_batch_size}: give at least 1")
    if dist.get_world_size() != mpu.get_model_parallel_world_size() * mpu.get_pipeline_model_parallel_world_size():
        raise InferenceInputError(f"the server runs one model: launch --model-parallel-size "
                                  f"({mpu.get_model_parallel_world_size()}) processes, not {dist.get_world_size()}")
    first = mpu.get_model_parallel_rank() == 0
    sock = listening_socket(args.host, args.port) if first else None   # a taken port fails before the load
    model = load_inference_model(args, "the text generation server", need_tokenizer=True)
    name = os.path.basename(os.path.normpath(args.load))
    runner = ModelRunner(model, get_tokenizer(), name, get_checkpoint_iteration(args.load)[0])
    if first:
        try:
            serve(runner, args, sock)
        finally:
            runner.close()
    else:
        runner.follow()


if __name__ == "__main__":
    run_main(main)
