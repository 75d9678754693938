"""An OpenAI-compatible HTTP server in front of the engine (`python -m minillm serve`).

    async_engine.py   the engine stepping in a background thread; one asyncio queue per request
    protocol.py       the request bodies (pydantic) and OpenAI's error shape
    metrics.py        /metrics under vLLM's names (prometheus-client)
    app.py            the routes (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health
    params.py         a body's fields checked and turned into SamplingParams, a grammar, the tools offered
    tools.py          tool calls: the prompt's tool section, the grammar of a call, calls parsed from text
    responses.py      the response objects in OpenAI's shapes (whole, chunks, logprobs, tool calls)
    streaming.py      answers on their way out: merged streams, a whole answer, server-sent events
    auth.py           the API key
Errors travel as types: an APIError carries its status, field and OpenAI error type; a SamplingParams
refusal names its field (sampling.ParamError); an output failed by the server says so (server_fault).
"""
from .app import create_app, serve
from .async_engine import AsyncEngine
from .metrics import ServerMetrics

__all__ = ["AsyncEngine", "ServerMetrics", "create_app", "serve"]
