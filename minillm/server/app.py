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

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import structured
from ..routing import TOP_LOGPROBS, RoutePolicy
from ..sampling import SamplingParams, check_vocab
from . import tools as tool_calls
from .async_engine import AsyncEngine, QueueFull
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       openapi_bodies, validation_message)

MAX_BODY_BYTES = 1 << 20      # 1 MiB: far more than a full context of text or token ids
MAX_TOKENS_DEFAULT = 1024     # a request without max_tokens stops here (--max-tokens-default), not at the context's end


class _API:
    """The routes of one model: an engine in its thread, the name it serves, its tokenizer."""

    def __init__(self, engine, aengine: AsyncEngine, model_name: str, metrics, max_tokens_default: int):
        self.engine, self.aengine, self.model_name, self.metrics = engine, aengine, model_name, metrics
        self.max_tokens_default = max_tokens_default
        self.tok = engine.tokenizer

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
        ids = self.tok.encode(body.prompt) if body.prompt is not None else \
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
        self._before_tokenizing(body, len(prompts), [p for p in prompts if isinstance(p, str)], "prompt")
        ids = [self.tok.encode(p) if isinstance(p, str) else p for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]     # echo: the prompt as it was sent
        return await self._run(request, body, ids, chat=False, texts=texts, gate=gate)

    async def chat_completions(self, request: Request, body: ChatRequest, gate=None):
        if not body.messages:
            raise APIError(400, "'messages' is empty: give at least one message", "messages")
        self._before_tokenizing(body, 1, ["".join(m.text() for m in body.messages)], "messages")
        tools, choice = self._tools(body)
        return await self._run(request, body, [self._chat_ids(body.messages, tools=tools if choice else None)],
                               chat=True, grammar=self._grammar(body, tools, choice), tools=bool(choice), gate=gate)

    @staticmethod
    def _tools(body) -> tuple[list[dict] | None, str | None]:
        """The functions offered, and which may be called: "auto", "required", a function's name, or None."""
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise APIError(400, "'tool_choice' needs 'tools': give the functions the model may call", "tool_choice")
        if tools and len({t["name"] for t in tools}) != len(tools):
            raise APIError(400, "two tools have the same name: each function needs its own", "tools")
        if not tools or choice == "none":
            return tools, None
        return tools, choice.function.name if hasattr(choice, "function") else choice or "auto"

    @staticmethod
    def _grammar(body, tools=None, choice=None) -> str | None:
        """The grammar of the answer: response_format's JSON, tool calls (text or JSON beside them under
        "auto"), or None for free text."""
        rf = body.response_format
        schema = None
        if rf is not None and rf.type == "json_object":
            schema = {"type": "object"}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(400, "response_format 'json_schema' needs 'json_schema': {'name', 'schema'}",
                               "response_format")
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
        try:
            if choice is not None:
                text = None if schema is None else \
                    "%json " + json.dumps({"x-guidance": tool_calls._COMPACT, **schema})
                return tool_calls.tools_grammar(tools, choice, body.parallel_tool_calls, text)
            return None if schema is None else structured.json_schema_grammar(schema)
        except ValueError as e:
            raise APIError(400, str(e), "tools" if choice is not None else "response_format") from None

    # ------------------------------------------------------------ the work
    def _before_tokenizing(self, body, num_prompts: int, texts: list[str], param: str) -> None:
        """What can be refused before any text is tokenized: too many sequences, and a text too long for the
        context whatever its tokens (a token covers at most max_token_bytes bytes)."""
        most = self.engine.scheduler.max_num_seqs
        if not 1 <= body.n * num_prompts <= most:       # every choice is a sequence of its own
            raise APIError(400, f"'n' x prompts must be in [1, {most}] (the sequences the server runs at once); "
                                f"got n={body.n} for {num_prompts} prompt(s)", "n")
        limit, per_token = self.engine.max_len, self.tok.max_token_bytes
        for text in texts:
            size = len(text.encode("utf-8", errors="replace"))
            if size > (limit - 1) * per_token:
                raise APIError(400, f"this model's context is {limit} tokens and the {param} has {size} bytes of "
                                    f"text, at least {-(-size // per_token)} tokens (a token covers at most "
                                    f"{per_token} bytes); shorten it", param, "context_length_exceeded")

    def _params(self, body, prompt_len: int, chat: bool, grammar: str | None = None) -> SamplingParams:
        max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
        limit = self.engine.max_len
        if prompt_len >= limit:
            raise APIError(400, f"this model's context is {limit} tokens and the prompt has {prompt_len}; "
                                f"shorten it to at most {limit - 1}", "messages" if chat else "prompt",
                           "context_length_exceeded")
        if max_tokens is not None and max_tokens >= 1 and prompt_len + max_tokens > limit:
            raise APIError(400, f"this model's context is {limit} tokens: the prompt has {prompt_len} and max_tokens "
                                f"asks for {max_tokens} more; lower max_tokens to at most {limit - prompt_len} or "
                                f"shorten the prompt", "max_tokens", "context_length_exceeded")
        echo = not chat and body.echo
        if max_tokens == 0 and not echo:
            raise APIError(400, "'max_tokens' must be an integer >= 1 (0 only with 'echo': true, to score the "
                                "prompt)", "max_tokens")
        if max_tokens == 0 and body.n != 1:
            raise APIError(400, "scoring a prompt (max_tokens 0) has one answer: 'n' must be 1", "n")
        logprobs = prompt_logprobs = None
        if chat and body.logprobs:
            logprobs = body.top_logprobs or 0
        elif chat and body.top_logprobs is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        elif not chat:
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if echo and body.logprobs is not None else (0 if max_tokens == 0 else None)
        if body.temperature > 2:
            raise APIError(400, f"'temperature' must be in [0, 2]; got {body.temperature}", "temperature")
        try:
            bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"'logit_bias' maps token ids to biases: its keys must be integers (as strings); "
                                f"got {list(body.logit_bias)[:5]}", "logit_bias") from None
        try:
            params = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p,
                max_tokens=min(limit - prompt_len, self.max_tokens_default) if max_tokens is None else max_tokens,
                stop=body.stop or (),
                seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, logit_bias=bias, grammar=grammar)
            check_vocab(params, self.engine.model.cfg.vocab_size)
            return params
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ", 1)[0]
            if param in ("logprobs", "prompt_logprobs"):          # the API's own names for them
                param = "top_logprobs" if chat else "logprobs"
                msg = param + " " + msg.split(" ", 1)[1]
            raise APIError(400, msg, param) from None

    async def _run(self, request: Request, body, prompts: list[list[int]], chat: bool, texts=None,
                   grammar: str | None = None, tools: bool = False, gate=None):
        """gate(request, outputs): when given, the whole answer is made first (with the log-probabilities the
        router reads) and gate says whether to send it (it returns the outputs again) or not (None: this
        returns None, for another model to answer)."""
        if not chat:
            grammar = self._grammar(body)
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty: give at least one token", "prompt")
        params = [self._params(body, len(p), chat, grammar) for p in prompts]
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
        shape = _Shape(rid, self.model_name, chat, self.tok, sum(map(len, prompts)), echo,
                       bool(body.logprobs) if chat else body.logprobs is not None, tools)
        outs = _merge(streams)
        if gate is not None and (outs := await gate(request, outs)) is None:
            return None
        if body.stream:
            opts = body.stream_options
            usage = "every" if opts and opts.continuous_usage_stats else "end" if opts and opts.include_usage else None
            return StreamingResponse(_sse(shape, outs, index, usage), media_type="text/event-stream")
        return await _whole(request, shape, outs, index)


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
        got = await _collect(request, outs)
        if got is None:
            raise APIError(499, "the client closed the connection")
        finals = [o for o in got if o.finished]
        if any(_failed(o) is not None for o in finals) or self.route.confident(finals):
            return _replay(got)
        return None


async def _api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request, e):
    msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code)


def _key_check(api_key: str | None):
    """A dependency of every route but /health: 'Authorization: Bearer <api_key>' when the server has a key,
    compared in constant time. (A dependency, not an HTTP middleware: Starlette's middleware wraps the
    connection's messages, and a handler behind it can miss the client's disconnect.)"""
    want = f"Bearer {api_key}".encode() if api_key is not None else None

    async def check_key(request: Request):
        if want is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), want):
            what = "a wrong API key" if given else "no API key"
            raise APIError(401, f"{what}: send the header 'Authorization: Bearer <key>' with the server's "
                                f"--api-key", code="invalid_api_key")
    return check_key


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_queued_requests: int | None = None, metrics=None, max_tokens_default: int = MAX_TOKENS_DEFAULT,
               route: RoutePolicy | None = None) -> FastAPI:
    """engine: an LLMEngine served as model_name, or {name: LLMEngine} for several models (each engine's
    thread starts with the app). metrics: a ServerMetrics, or None for a new one. max_tokens_default: the
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
        apis[name] = _API(eng, AsyncEngine(eng, m, max_queued_requests), name, m, max_tokens_default)
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
    keyed = {"dependencies": [Depends(_key_check(api_key))]}
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
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as e:
        raise APIError(400, *validation_message(e)) from None


async def _merge(streams):
    """Outputs of several engine requests (one per prompt), as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(s):
        try:
            async for out in s:
                await q.put(out)
        finally:
            await q.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            out = await q.get()
            if out is None:
                left -= 1
            else:
                yield out
    finally:
        for t in tasks:
            t.cancel()


class _Shape:
    """Builds the response objects of one API call (completion or chat, whole or chunked)."""

    def __init__(self, rid, model, chat, tok, prompt_tokens, echo=None, want_logprobs=False, tools=False):
        """echo: completions with echo, per choice (the prompt's text, its ids). want_logprobs: the request
        asked for logprobs (a router may have them computed without). tools: chat answers may be tool calls (tools.py), parsed into tool_calls."""
        self.rid, self.model, self.chat, self.tok = rid, model, chat, tok
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.echo, self.want_logprobs = echo, want_logprobs
        self.offsets: dict[int, int] = {}        # streamed completions: each choice's text so far, in characters
        self.tools = tools
        self.tool_streams: dict[int, tool_calls.ToolCallStream] = {}   # streamed chat with tools, per choice

    def obj(self, kind: str, choices: list, usage=None) -> dict:
        d = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return d

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def logprobs(self, token_ids, logprobs):
        """Chat's logprobs object for these tokens (None when not asked for)."""
        if logprobs is None or not self.want_logprobs:
            return None

        def entry(tid, lp):
            b = self.tok.decode_bytes([tid])
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for t, (lp, top) in zip(token_ids, logprobs)]}

    def text_logprobs(self, token_ids, logprobs, offset: int = 0) -> dict:
        """Completions' (legacy) logprobs object: per token its text, log-probability and a dict of the
        best alternatives (with the token itself, as vLLM gives it), None for a prompt's first token;
        text_offset: where each token's text starts in the answer's text."""
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        piece = lambda t: self.tok.decode_bytes([t]).decode("utf-8", errors="replace")   # noqa: E731
        for t, e in zip(token_ids, logprobs):
            text = piece(t)
            d["tokens"].append(text)
            d["text_offset"].append(offset)
            offset += len(text)
            d["token_logprobs"].append(None if e is None else e[0])
            d["top_logprobs"].append(None if e is None else {piece(i): v for i, v in e[1]} | {text: e[0]})
        return d

    def _completion(self, index: int, out, text: str, token_ids, logprobs, first: bool) -> tuple[str, dict | None]:
        """A completion choice's text and logprobs; with echo, the prompt's come first (in the first chunk)."""
        prompt_text, prompt_ids = self.echo[index] if self.echo and first else ("", [])
        if not self.want_logprobs:
            return prompt_text + text, None
        base = self.offsets.get(index, 0)
        lp = self.text_logprobs(token_ids, logprobs or [], base + len(prompt_text))
        if prompt_ids:
            scored = self.text_logprobs(prompt_ids, out.prompt_logprobs, base)
            lp = {k: scored[k] + lp[k] for k in lp}
        return prompt_text + text, lp

    def choice(self, index: int, out) -> dict:
        if self.chat:
            message, reason = {"role": "assistant", "content": out.text}, out.finish_reason
            calls, rest = tool_calls.split_calls(out.text) if self.tools else ([], out.text)
            if calls:                   # (cut short by max_tokens: the whole calls, the tail as content)
                message = {"role": "assistant", "content": rest.strip("\n") or None, "tool_calls": calls}
                reason = "length" if reason == "length" else "tool_calls"
            return {"index": index, "message": message, "logprobs": self.logprobs(out.token_ids, out.logprobs),
                    "finish_reason": reason}
        text, lp = self._completion(index, out, out.text, out.token_ids, out.logprobs, first=True)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}

    def delta(self, index: int, out, first: bool, token_ids: list[int], logprobs) -> dict:
        """A chunk's choice: the output's new text, with the tokens (and logprobs) since the last chunk."""
        reason, text = out.finish_reason if out.finished else None, out.new_text
        if self.chat and self.tools:
            return self._tool_delta(index, out, first, token_ids, logprobs)
        if self.chat:
            d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": d, "logprobs": self.logprobs(token_ids, logprobs), "finish_reason": reason}
        text, lp = self._completion(index, out, text, token_ids, logprobs, first)
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}


    def _tool_delta(self, index: int, out, first: bool, token_ids, logprobs) -> dict:
        """A chat chunk's choice under tools: content as it comes, or each tool call once it is whole."""
        stream = self.tool_streams.setdefault(index, tool_calls.ToolCallStream())
        d = {"role": "assistant"} if first else {}
        for part in stream.push(out.new_text, out.finished):
            if "content" in part:
                d["content"] = d.get("content", "") + part["content"]
            else:
                d.setdefault("tool_calls", []).extend(part["tool_calls"])
        if first and "content" not in d and "tool_calls" not in d:
            d["content"] = ""
        reason = out.finish_reason if out.finished else None
        if reason and stream.called and reason != "length":
            reason = "tool_calls"
        return {"index": index, "delta": d, "logprobs": self.logprobs(token_ids, logprobs), "finish_reason": reason}


def _failed(out) -> APIError | None:
    if out.finish_reason == "error":
        server_fault = out.error and out.error.startswith(("sampling failed", "the model step failed",
                                                           "the engine stopped"))
        return APIError(500 if server_fault else 400, out.error or "the request failed")
    return None


async def _collect(request: Request, outs) -> list | None:
    """Every output of a whole answer, in order; None if the client went away first (the requests are
    aborted: the generator's finally does it)."""
    got = []

    async def collect():
        async for out in outs:
            got.append(out)

    async def gone():                   # the ASGI server says http.disconnect when the client leaves
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(gone())
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    work.result()
    return got


async def _replay(got: list):
    """Outputs already made, as the stream they came in."""
    for out in got:
        yield out


async def _whole(request: Request, shape: _Shape, outs, index: dict) -> JSONResponse:
    """A non-streamed answer; the request is aborted if the client goes away before it is done."""
    got = await _collect(request, outs)
    if got is None:
        return JSONResponse(APIError(499, "the client closed the connection").body(), status_code=499)
    final = {out.request_id: out for out in got if out.finished}
    for out in final.values():
        if (err := _failed(out)) is not None:
            raise err
    choices = [shape.choice(index[r], o) for r, o in sorted(final.items(), key=lambda kv: index[kv[0]])]
    usage = shape.usage(sum(len(o.token_ids) for o in final.values()))
    return JSONResponse(shape.obj("chat.completion" if shape.chat else "text_completion", choices, usage))


async def _sse(shape: _Shape, outs, index: dict, usage: str | None):
    """Server-sent events: a chunk per new piece of text, per choice; the usage chunk; [DONE].
    usage: None, "end" (include_usage: a last chunk with it) or "every" (continuous_usage_stats: the usage
    so far in every chunk too)."""
    kind = "chat.completion.chunk" if shape.chat else "text_completion"
    started: set[str] = set()                      # request ids with a chunk sent
    held: dict[str, tuple[list, list]] = {}        # tokens (and logprobs) of outputs with no text to send yet
    completion_tokens = 0
    try:
        async for out in outs:
            if (err := _failed(out)) is not None:
                yield f"data: {json.dumps(err.body())}\n\n"
                continue
            completion_tokens += len(out.new_token_ids)
            ids, lps = held.pop(out.request_id, ([], []))
            ids, lps = ids + out.new_token_ids, lps + (out.new_logprobs or [])
            first = out.request_id not in started
            if not out.new_text and not out.finished and not (shape.chat and first):
                held[out.request_id] = (ids, lps)         # sent with the next chunk that has text
                continue
            choice = shape.delta(index[out.request_id], out, first, ids, lps if out.new_logprobs is not None else None)
            if shape.chat and not choice["delta"] and choice["finish_reason"] is None:
                held[out.request_id] = (ids, lps)         # (a tool call not whole yet)
                continue
            started.add(out.request_id)
            extra = {"usage": shape.usage(completion_tokens) if usage == "every" else None} if usage else {}
            yield f"data: {json.dumps(shape.obj(kind, [choice]) | extra)}\n\n"
        if usage:
            yield f"data: {json.dumps(shape.obj(kind, [], shape.usage(completion_tokens)))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await outs.aclose()             # a client gone mid-stream: this aborts its requests


def serve(engine, model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_queued_requests: int | None = None, graceful_timeout_s: float = 30.0,
          log_level: str = "info", max_tokens_default: int = MAX_TOKENS_DEFAULT, route: RoutePolicy | None = None) -> None:
    """Run the server until Ctrl-C / SIGTERM. On shutdown it stops taking connections, lets running
    answers finish for up to graceful_timeout_s, then aborts what is left and closes those streams."""
    import uvicorn

    app = create_app(engine, model_name, api_key, max_queued_requests, max_tokens_default=max_tokens_default,
                     route=route)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s)
