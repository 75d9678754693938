"""The HTTP routes: OpenAI's API in front of one AsyncEngine per model served.

    GET  /v1/models             the models served (and /v1/models/{id})
    POST /v1/completions        prompt (text or token ids, one or a list) -> text; with echo and
                                logprobs, the prompt scored token by token (what lm-eval asks)
    POST /v1/chat/completions   messages -> the assistant's answer
    POST /tokenize, /detokenize text or messages <-> token ids (vLLM's shapes)
    GET  /tokenizer_info        the special tokens and context length (vLLM's; lm-eval reads it)
    GET  /health                200 while the engine thread runs (no API key needed)
    GET  /metrics               Prometheus text (metrics.py)

A request goes to the model its `model` field names. A server with a routing policy
(`routing.RoutePolicy`) also serves `"auto"`: the cheap model answers, and when its answer's confidence
is below the threshold the exact model answers instead (a streamed answer is held until that is known).
The response's `model` says which one answered.

`"stream": true` answers with server-sent events: one `data: {chunk}` per new piece of text and
`data: [DONE]` at the end. A client that goes away mid-answer aborts its request: the engine frees
its blocks before its next step. Every refusal is one JSON error in OpenAI's shape, and no refusal
touches another request.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..routing import TOP_LOGPROBS, RoutePolicy
from . import tools as tool_calls
from .async_engine import AsyncEngine, QueueFull
from .auth import key_check
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       openapi_bodies, validation_message)
from .params import Limits, answer_grammar, check_sizes, sampling_params, tools_offered
from .responses import Shape, failed
from .streaming import collect, merge, replay, sse, whole

MAX_BODY_BYTES = 1 << 20      # 1 MiB: far more than a full context of text or token ids
MAX_TOKENS_DEFAULT = 1024     # a request without max_tokens stops here (--max-tokens-default), not at the context's end


class _API:
    """The routes of one model: an engine in its thread, the name it serves, its tokenizer."""

    def __init__(self, engine, aengine: AsyncEngine, model_name: str, metrics, max_tokens_default: int):
        self.engine, self.aengine, self.model_name, self.metrics = engine, aengine, model_name, metrics
        self.tok = engine.tokenizer
        self.limits = Limits(engine.scheduler.max_num_seqs, engine.max_len, self.tok.max_token_bytes,
                             engine.model.cfg.vocab_size, max_tokens_default)

    # ------------------------------------------------------------ simple routes
    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "minillm",
                "max_model_len": self.engine.max_len}

    async def tokenizer_info(self):
        tok = self.tok
        piece = lambda i: None if i is None else tok.id_to_piece(i)   # noqa: E731
        return {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
                "model_max_length": self.engine.max_len, "bos_token": piece(tok.bos_id),
                "eos_token": piece(tok.eos_id), "pad_token": None,
                "stop_tokens": sorted(tok.id_to_piece(i) for i in tok.stop_ids)}

    async def tokenize(self, body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either 'prompt' (a text) or 'messages' (a chat), not both or neither", "prompt")
        ids = self.tok.encode_prompt(body.prompt) if body.prompt is not None else \
            self._chat_ids(body.messages, body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": self.engine.max_len, "tokens": ids,
                "token_strs": [self.tok.id_to_piece(i) for i in ids] if body.return_token_strs else None}

    async def detokenize(self, body: DetokenizeRequest):
        try:
            return {"prompt": self.tok.decode(body.tokens)}
        except ValueError as e:
            raise APIError(400, str(e), "tokens") from None

    def _chat_ids(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 "tool_calls": [c.model_dump() for c in m.tool_calls or ()]} for m in messages]
        msgs = tool_calls.render_messages(msgs, tools)
        try:
            return self.tok.apply_chat_template(msgs, add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    # ------------------------------------------------------------ generation routes
    async def completions(self, request: Request, body: CompletionRequest, gate=None):
        """gate: the router's check of the finished answer (see _run)."""
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and \
            isinstance(body.prompt[0], (str, list)) else [body.prompt]
        check_sizes(self.limits, body, len(prompts), [p for p in prompts if isinstance(p, str)], "prompt")
        ids = [self.tok.encode_prompt(p) if isinstance(p, str) else p for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]     # echo: the prompt as it was sent
        return await self._run(request, body, ids, chat=False, texts=texts, gate=gate)

    async def chat_completions(self, request: Request, body: ChatRequest, gate=None):
        if not body.messages:
            raise APIError(400, "'messages' is empty: give at least one message", "messages")
        check_sizes(self.limits, body, 1, ["".join(m.text() for m in body.messages)], "messages")
        tools, choice = tools_offered(body)
        return await self._run(request, body, [self._chat_ids(body.messages, tools=tools if choice else None)],
                               chat=True, grammar=answer_grammar(body, tools, choice), tools=bool(choice), gate=gate)

    async def _run(self, request: Request, body, prompts: list[list[int]], chat: bool, texts=None,
                   grammar: str | None = None, tools: bool = False, gate=None):
        """gate(request, outputs): when given, the whole answer is made first (with the log-probabilities the
        router reads) and gate says whether to send it (it returns the outputs again) or not (None: this
        returns None, for another model to answer)."""
        if not chat:
            grammar = answer_grammar(body)
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty: give at least one token", "prompt")
        params = [sampling_params(self.limits, body, len(p), chat, grammar) for p in prompts]
        if gate is not None:
            params = [p if p.logprobs is not None else dataclasses.replace(p, logprobs=TOP_LOGPROBS) for p in params]
        for p in prompts:
            try:
                self.engine.check_prompt(p)
            except ValueError as e:
                raise APIError(400, str(e), "prompt") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if not self.aengine.healthy:
            raise APIError(503, f"the engine is not running: {self.aengine.error!r}")
        try:
            self.aengine.check_room(len(prompts))
        except QueueFull as e:
            raise APIError(503, str(e), code="queue_full") from None
        streams = [self.aengine.generate(f"{rid}-{i}", p, sp, body.n) for i, (p, sp) in enumerate(zip(prompts, params))]
        index = {f"{rid}-{i}" + (f"/{j}" if j else ""): i * body.n + j for i in range(len(prompts)) for j in range(body.n)}
        echo = None
        if not chat and body.echo:           # per choice: the prompt's text and ids
            echo = [(t if t is not None else self.tok.decode(p), p) for p, t in zip(prompts, texts) for _ in range(body.n)]
        shape = Shape(rid, self.model_name, chat, self.tok, sum(map(len, prompts)), echo,
                       bool(body.logprobs) if chat else body.logprobs is not None, tools)
        outs = merge(streams)
        if gate is not None and (outs := await gate(request, outs)) is None:
            return None
        if body.stream:
            opts = body.stream_options
            usage = "every" if opts and opts.continuous_usage_stats else "end" if opts and opts.include_usage else None
            return StreamingResponse(sse(shape, outs, index, usage), media_type="text/event-stream")
        return await whole(request, shape, outs, index)


class _Server:
    """The routes of a server: each request to the model its 'model' field names, or through the router."""

    def __init__(self, apis: dict[str, _API], metrics, route: RoutePolicy | None):
        self.apis, self.metrics, self.route = apis, metrics, route
        self.default = next(iter(apis.values()))

    async def health(self):
        for api in self.apis.values():
            if not api.aengine.healthy:
                return JSONResponse(APIError(503, f"the engine of '{api.model_name}' is not running: "
                                                  f"{api.aengine.error!r}").body(), 503)
        return {"status": "ok"}

    async def get_metrics(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _cards(self) -> list[dict]:
        cards = [api._card() for api in self.apis.values()]
        if self.route is not None:
            r = self.route
            cards.append({**self.apis[r.cheap]._card(), "id": r.name, "routing": {
                "cheap": r.cheap, "exact": r.exact, "signal": r.signal, "threshold": r.threshold}})
        return cards

    async def models(self):
        return {"object": "list", "data": self._cards()}

    async def model(self, model_id: str):
        for card in self._cards():
            if card["id"] == model_id:
                return card
        self._pick(model_id)                          # (the error)

    async def tokenizer_info(self):
        return await self.default.tokenizer_info()

    def _pick(self, model: str | None) -> _API:
        """The model a request names (tokenize and detokenize may leave it out: the first model's tokenizer)."""
        if model is None:
            return self.default
        if model in self.apis:
            return self.apis[model]
        if self.route is not None and model == self.route.name:
            return self.apis[self.route.cheap]
        names = ", ".join(f"'{c['id']}'" for c in self._cards())
        raise APIError(404, f"the model '{model}' does not exist; this server has {names} (GET /v1/models)",
                       "model", "model_not_found")

    async def tokenize(self, request: Request):
        body = await _parse(request, TokenizeRequest)
        return await self._pick(body.model).tokenize(body)

    async def detokenize(self, request: Request):
        body = await _parse(request, DetokenizeRequest)
        return await self._pick(body.model).detokenize(body)

    async def completions(self, request: Request):
        return await self._answer(request, await _parse(request, CompletionRequest), chat=False)

    async def chat_completions(self, request: Request):
        return await self._answer(request, await _parse(request, ChatRequest), chat=True)

    async def _answer(self, request: Request, body, chat: bool):
        run = lambda api, **kw: (api.chat_completions if chat else api.completions)(request, body, **kw)  # noqa: E731
        if self.route is None or body.model != self.route.name:
            return await run(self._pick(body.model))
        r = self.route                                    # "auto": the cheap model, the exact one if unsure
        answer = await run(self.apis[r.cheap], gate=self._gate)
        self.metrics.routed.labels(r.name, r.cheap if answer is not None else r.exact).inc()
        return answer if answer is not None else await run(self.apis[r.exact])

    async def _gate(self, request: Request, outs):
        """The cheap model's whole answer: sent (replayed) if it is sure enough or failed, else None."""
        got = await collect(request, outs)
        if got is None:
            raise APIError(499, "the client closed the connection")
        finals = [o for o in got if o.finished]
        if any(failed(o) is not None for o in finals) or self.route.confident(finals):
            return replay(got)
        return None


async def _api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request, e):
    msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code)


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_queued_requests: int | None = None, metrics=None, max_tokens_default: int = MAX_TOKENS_DEFAULT,
               route: RoutePolicy | None = None, engine_threads: dict | None = None) -> FastAPI:
    """engine: an LLMEngine served as model_name, or {name: LLMEngine} for several models (each engine's
    thread starts with the app; engine_threads: {name: the engine_thread() that built it}, to step it there). metrics: a ServerMetrics, or None for a new one. max_tokens_default: the
    most tokens a request without max_tokens gets (one request cannot hold the engine to the end of the
    context). route: also serve route.name ("auto"), routed between two of the models."""
    from .metrics import ServerMetrics

    engines = dict(engine) if isinstance(engine, dict) else {model_name: engine}
    if not engines or not all(isinstance(n, str) and n for n in engines):
        raise ValueError(f"every model served needs a name; got {list(engines)}")
    if route is not None and ({route.cheap, route.exact} - set(engines) or route.name in engines):
        raise ValueError(f"the routing policy routes '{route.name}' between '{route.cheap}' and '{route.exact}': both "
                         f"must be served ({', '.join(engines)}) and '{route.name}' must not be")
    first = next(iter(engines))
    metrics = metrics or ServerMetrics(first)
    apis = {}
    for name, eng in engines.items():
        m = metrics if name == first else ServerMetrics(name, share=metrics)
        aengine = AsyncEngine(eng, m, max_queued_requests, runs_on=(engine_threads or {}).get(name))
        apis[name] = _API(eng, aengine, name, m, max_tokens_default)
    server = _Server(apis, metrics, route)

    @asynccontextmanager
    async def lifespan(app):
        for api in apis.values():
            api.aengine.start()
        yield
        for api in apis.values():
            api.aengine.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.engine, app.state.metrics = apis[first].aengine, metrics
    app.state.engines = {name: api.aengine for name, api in apis.items()}
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.get("/health")(server.health)
    keyed = {"dependencies": [Depends(key_check(api_key))]}
    app.get("/metrics", **keyed)(server.get_metrics)
    app.get("/v1/models", **keyed)(server.models)
    app.get("/v1/models/{model_id:path}", **keyed)(server.model)
    app.get("/tokenizer_info", **keyed)(server.tokenizer_info)
    bodies, components = openapi_bodies(TokenizeRequest, DetokenizeRequest, CompletionRequest, ChatRequest)
    app.post("/tokenize", **keyed, openapi_extra=bodies[TokenizeRequest])(server.tokenize)
    app.post("/detokenize", **keyed, openapi_extra=bodies[DetokenizeRequest])(server.detokenize)
    app.post("/v1/completions", **keyed, openapi_extra=bodies[CompletionRequest])(server.completions)
    app.post("/v1/chat/completions", **keyed, openapi_extra=bodies[ChatRequest])(server.chat_completions)
    plain_openapi = app.openapi

    def openapi():                      # the bodies' schemas beside the routes that name them
        if app.openapi_schema is None:
            schema = plain_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema
    app.openapi = openapi
    return app


async def _parse(request: Request, model):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {int(size)} bytes; the limit is {MAX_BODY_BYTES}")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:              # the client hung up mid-body: nothing to answer, nothing to log
        raise APIError(400, "the client closed the connection before its body was complete") from None
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as e:
        raise APIError(400, *validation_message(e)) from None


def serve(engine, model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_queued_requests: int | None = None, graceful_timeout_s: float = 30.0,
          log_level: str = "info", max_tokens_default: int = MAX_TOKENS_DEFAULT, route: RoutePolicy | None = None,
          engine_threads: dict | None = None) -> None:
    """Run the server until Ctrl-C / SIGTERM. On shutdown it stops taking connections, lets running
    answers finish for up to graceful_timeout_s, then aborts what is left and closes those streams."""
    import uvicorn

    app = create_app(engine, model_name, api_key, max_queued_requests, max_tokens_default=max_tokens_default,
                     route=route, engine_threads=engine_threads)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s)
