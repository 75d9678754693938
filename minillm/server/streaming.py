"""An answer on its way out: several engine streams merged (`merge`), a whole answer collected while
watching for the client leaving (`collect`, `whole`), or sent as server-sent events, one chunk per new
piece of text (`sse`). A client that goes away aborts its requests (the streams' generators do it)."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse

from .protocol import APIError
from .responses import Shape, failed


async def merge(streams):
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


async def collect(request: Request, outs) -> list | None:
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


async def replay(got: list):
    """Outputs already made, as the stream they came in."""
    for out in got:
        yield out


async def whole(request: Request, shape: Shape, outs, index: dict) -> JSONResponse:
    """A non-streamed answer; the request is aborted if the client goes away before it is done."""
    got = await collect(request, outs)
    if got is None:
        return JSONResponse(APIError(499, "the client closed the connection").body(), status_code=499)
    final = {out.request_id: out for out in got if out.finished}
    for out in final.values():
        if (err := failed(out)) is not None:
            raise err
    choices = [shape.choice(index[r], o) for r, o in sorted(final.items(), key=lambda kv: index[kv[0]])]
    usage = shape.usage(sum(len(o.token_ids) for o in final.values()))
    return JSONResponse(shape.obj("chat.completion" if shape.chat else "text_completion", choices, usage))


async def sse(shape: Shape, outs, index: dict, usage: str | None):
    """Server-sent events: a chunk per new piece of text, per choice; the usage chunk; [DONE].
    usage: None, "end" (include_usage: a last chunk with it) or "every" (continuous_usage_stats: the usage
    so far in every chunk too)."""
    kind = "chat.completion.chunk" if shape.chat else "text_completion"
    started: set[str] = set()                      # request ids with a chunk sent
    held: dict[str, tuple[list, list]] = {}        # tokens (and logprobs) of outputs with no text to send yet
    completion_tokens = 0
    try:
        async for out in outs:
            if (err := failed(out)) is not None:
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
