"""The HTTP routes (FastAPI): OpenAI's completions, chat completions and models, Megatron's PUT /api, vLLM's
tokenizer endpoints (what lm-eval's local-completions tokenizes with), /health and the chat page.

    app = create_app(runner, api_key="secret", max_batch_size=8, model_name="gpt2-small")
    uvicorn.run(app)          # tools/run_text_generation_server.py does this on model-parallel rank 0

Every refusal is an OpenAI error object {"error": {"message", "type", "param", "code"}} with its HTTP status:
400 (bad JSON, field, value), 401 (API key), 404 (route, model), 405 (method), 413 (body too large).
"""
import asyncio
import json
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from megatron.posttrain import DEFAULT_TEMPLATE, TEMPLATES

from . import megatron_api, responses
from .batcher import Batcher, Work
from .protocol import APIError, Limits, parse_chat, parse_completion

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_BODY_BYTES = 1 << 20
"""The largest request body read (1 MiB): a bigger one is refused with 413 before it is parsed."""
EOD_TEXT = "<|endoftext|>"


def create_app(runner, *, api_key=None, max_batch_size=8, model_name=None, chat_template=DEFAULT_TEMPLATE,
               max_body_bytes=MAX_BODY_BYTES):
    """The server's FastAPI app over `runner` (a ModelRunner on model-parallel rank 0)."""
    name = model_name or runner.name
    template = TEMPLATES[chat_template]
    limits = Limits(runner.max_positions, runner.vocab_size, runner.tokenizer)
    batcher = Batcher(runner, max_batch_size)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        batcher.close()

    app = FastAPI(title="Megatron text generation", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.batcher = batcher

    @app.exception_handler(APIError)
    async def api_error(_request, error):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def server_error(_request, error):   # a bug: the request fails, the server stays up
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}: {error}", None, "internal_error",
                                     kind="server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(APIError(error.status_code, str(error.detail), None, code).body(),
                            status_code=error.status_code)

    async def body_of(request):
        """The request's JSON (API key checked, size bounded)."""
        check_key(request, api_key)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise _too_large(max_body_bytes)
        data = b""
        async for piece in request.stream():
            data += piece
            if len(data) > max_body_bytes:
                raise _too_large(max_body_bytes)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the body is not valid JSON ({error})", None, "invalid_json") from None

    def check_model(body):
        if "model" in body and body["model"] is not None and body["model"] != name:
            raise APIError(404, f"model {body['model']!r} is not served here: this server serves {name!r} "
                                "(GET /v1/models)", "model", "model_not_found")

    def submit(request):
        work = Work(request, runner, asyncio.get_running_loop())
        batcher.submit(work)
        return work

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        check_model(body)
        work = submit(parse_completion(body, limits))
        if work.request.stream:
            return _sse(_completion_stream(work, name))
        await _finished(work)
        return responses.completion(work, name, runner.tokenizer.detokenize)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        check_model(body)
        work = submit(parse_chat(body, limits, template))
        if work.request.stream:
            return _sse(_chat_stream(work, name, template))
        await _finished(work)
        return responses.chat(work, name, template, runner.tokenizer.detokenize)

    @app.put("/api")
    async def megatron_generate(request: Request):
        body = await body_of(request)
        work = submit(megatron_api.parse(body, limits))
        await _finished(work)
        return megatron_api.answer(work, runner.tokenizer.detokenize)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, api_key)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "megatron",
                                            "iteration": runner.iteration, "max_model_len": runner.max_positions}]}

    @app.get("/health")
    async def health():
        stats = batcher.stats
        return {"status": "ok", "model": name, "iteration": runner.iteration, "waiting": batcher.waiting,
                "running_rows": stats.running_rows, "batches": stats.batches, "largest_batch": stats.largest_batch}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        check_key(request, api_key)
        return {"eos_token": EOD_TEXT, "bos_token": None, "pad_token": None, "model_max_length": runner.max_positions,
                "tokenizer_class": "GPT2BPETokenizer"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string", "prompt", "invalid_type")
        return {"tokens": encode_with_eod(runner.tokenizer, text), "max_model_len": runner.max_positions}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < runner.vocab_size for t in ids):
            raise APIError(400, f"tokens must be a list of ids in [0, {runner.vocab_size})", "tokens", "invalid_value")
        return {"prompt": runner.tokenizer.detokenize(ids)}

    @app.get("/")
    async def page():
        path = os.path.join(STATIC, "chat.html")
        if not os.path.isfile(path):
            raise HTTPException(404, "no chat page is installed (megatron/serving/static/chat.html)")
        return FileResponse(path, media_type="text/html")

    return app


def check_key(request, api_key):
    """401 unless the request carries `Authorization: Bearer <api_key>` (when the server has a key)."""
    if api_key is None:
        return
    if request.headers.get("authorization", "") != f"Bearer {api_key}":
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                            "server's --api-key", None, "invalid_api_key", kind="authentication_error")


def encode_with_eod(tokenizer, text):
    """Ids of `text`, each literal <|endoftext|> being the end-of-text id (as Hugging Face's GPT-2 tokenizer and
    vLLM's /tokenize do: lm-eval finds the end-of-text id by tokenizing it)."""
    ids = []
    for index, piece in enumerate(text.split(EOD_TEXT)):
        if index:
            ids.append(tokenizer.eod)
        ids += tokenizer.tokenize(piece) if piece else []
    return ids


def _too_large(limit):
    return APIError(413, f"the request body is larger than {limit} bytes: send less (fewer or shorter prompts)",
                    None, "request_too_large")


async def _finished(work):
    """Wait for the batcher to finish `work` (its deltas are for streams only); re-raise its error."""
    async for _ in _events(work):
        pass


def _sse(chunks):
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream")


async def _events(work):
    """The stream's ("delta", choice, text) events until the work is done; a closed stream cancels the work."""
    try:
        while True:
            event = await work.events.get()
            if event[0] == "done":
                return
            if event[0] == "error":
                raise event[1]
            yield event
    finally:
        work.cancel()


async def _completion_stream(work, name):
    ident = responses.new_id("cmpl")
    async for _, index, text in _events(work):
        yield responses.completion_chunk(ident, name, index, text)
    for index, row in enumerate(work.rows):
        yield responses.completion_chunk(ident, name, index, "", row.finish_reason)
    if work.include_usage:
        yield dict(responses.completion_chunk(ident, name, 0, ""), choices=[], usage=responses.usage(work))


async def _chat_stream(work, name, template):
    ident = responses.new_id("chatcmpl")
    for index in range(len(work.rows)):
        yield responses.chat_chunk(ident, name, index, {"role": "assistant", "content": ""})
    started = [False] * len(work.rows)
    prefix = template.response_prefix
    async for _, index, text in _events(work):
        if not started[index] and text.startswith(prefix):   # the template's space before the answer
            text = text[len(prefix):]
        started[index] = True
        if text:
            yield responses.chat_chunk(ident, name, index, {"content": text})
    for index, row in enumerate(work.rows):
        yield responses.chat_chunk(ident, name, index, {}, row.finish_reason)
    if work.include_usage:
        yield dict(responses.chat_chunk(ident, name, 0, {}), choices=[], usage=responses.usage(work))
