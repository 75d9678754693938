"""A real uvicorn server on a free loopback port, in a thread of the test process (so it shares the
loaded model), for as long as a `with` block lasts."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from minillm.engine import LLMEngine
from minillm.server import create_app
from minillm.course.launch_server import free_port


@contextmanager
def live_server(model, tokenizer, name="smol", api_key=None, max_queued_requests=None, max_tokens_default=None,
                route=None, **engine_options):
    """model: one model served as `name`, or {name: model} for several (then the engine yielded is a dict)."""
    options = {"kv_cache_memory": 64 << 20, "verbose": False, **engine_options}
    if isinstance(model, dict):
        engine = {n: LLMEngine(m, tokenizer, **options) for n, m in model.items()}
    else:
        engine = LLMEngine(model, tokenizer, **options)
    app = create_app(engine, name, api_key=api_key, max_queued_requests=max_queued_requests, route=route,
                     **({} if max_tokens_default is None else {"max_tokens_default": max_tokens_default}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app, engine
    finally:
        server.should_exit = True
        thread.join(15)
