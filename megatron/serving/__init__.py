"""The text-generation server (tools/run_text_generation_server.py): OpenAI's completions and chat completions,
Megatron's PUT /api, over a checkpoint of either path at any model-parallel size.

    app.py           the HTTP routes (create_app)
    protocol.py      request fields -> GenerationRequest; the OpenAI error object (APIError)
    megatron_api.py  Megatron-LM's PUT /api fields and answer
    batcher.py       requests -> batches, on one thread that owns the model
    rows.py          one choice while it is generated: text, stop strings, finish reason
    model_runner.py  generate/score on rank 0, the other model-parallel ranks following by broadcast
    responses.py     the JSON answers and stream chunks
"""
from .app import create_app
from .model_runner import ModelRunner
from .protocol import APIError, GenerationRequest

__all__ = ["create_app", "ModelRunner", "APIError", "GenerationRequest"]
