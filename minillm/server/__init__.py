"""An OpenAI-compatible HTTP server in front of the engine (`python -m minillm serve`).

    async_engine.py   the engine stepping in a background thread; one asyncio queue per request
    protocol.py       the request bodies (pydantic) and OpenAI's error shape
    metrics.py        /metrics under vLLM's names (prometheus-client)
    app.py            the routes (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health
"""
from .app import create_app, serve
from .async_engine import AsyncEngine
from .metrics import ServerMetrics

__all__ = ["AsyncEngine", "ServerMetrics", "create_app", "serve"]
