"""The response objects of one API call, in OpenAI's shapes: a completion or a chat answer, whole or in
chunks, with usage, log-probabilities and tool calls (`Shape`); and the error a failed output answers with
(`failed`): a 500 where the server failed it, a 400 where the request did."""
from __future__ import annotations

import time

from . import tools as tool_calls
from .protocol import APIError


class Shape:
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
        self.sent_bytes: dict[int, list[int]] = {}    # streamed: each choice's [text bytes, token bytes] so far
        self.pending: dict[int, list] = {}            # streamed: each choice's tokens ahead of its text

    def obj(self, kind: str, choices: list, usage=None) -> dict:
        d = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return d

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def within(self, token_ids, logprobs, text_bytes: int, start: int = 0):
        """The tokens (and logprobs) that start inside the answer's first text_bytes bytes, start: the bytes of
        its tokens before these. A stop string cuts the text; the tokens past the cut go with it."""
        n, _ = self._span(token_ids, text_bytes, start)
        return token_ids[:n], None if logprobs is None else logprobs[:n]

    def _span(self, token_ids, text_bytes: int, start: int = 0) -> tuple[int, int]:
        """(how many of the tokens start before byte text_bytes, the byte where the last of them ends)."""
        n, pos = 0, start
        for t in token_ids:
            if pos >= text_bytes:
                break
            pos, n = pos + len(self.tok.decode_bytes([t])), n + 1
        return n, pos

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
            calls, content = tool_calls.split_answer(out.text) if self.tools else ([], out.text)
            message, reason = {"role": "assistant", "content": content}, out.finish_reason
            if calls:                   # (cut short by max_tokens: the whole calls, and "length")
                message["tool_calls"] = calls
                reason = "length" if reason == "length" else "tool_calls"
            kept = self.within(out.token_ids, out.logprobs, len(out.text.encode()))
            return {"index": index, "message": message, "logprobs": self.logprobs(*kept), "finish_reason": reason}
        ids, lps = self.within(out.token_ids, out.logprobs, len(out.text.encode()))
        text, lp = self._completion(index, out, out.text, ids, lps, first=True)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}

    def delta(self, index: int, out, first: bool, token_ids: list[int], logprobs) -> dict:
        """A chunk's choice: the output's new text, with the tokens (and logprobs) since the last chunk."""
        reason, text = out.finish_reason if out.finished else None, out.new_text
        if self.chat and self.tools:
            return self._tool_delta(index, out, first, token_ids, logprobs)
        # a token goes out with the chunk whose text reaches it: the text lags the tokens (a possible stop
        # string is held back), and the tokens a stop string cuts off never go out
        sent, pending = self.sent_bytes.setdefault(index, [0, 0]), self.pending.get(index, [])
        pairs = pending + list(zip(token_ids, logprobs if logprobs is not None else [None] * len(token_ids)))
        sent[0] += len(text.encode())
        n, sent[1] = self._span([t for t, _ in pairs], sent[0], sent[1])
        self.pending[index] = [] if out.finished else pairs[n:]
        token_ids, logprobs = [t for t, _ in pairs[:n]], None if logprobs is None else [lp for _, lp in pairs[:n]]
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


def failed(out) -> APIError | None:
    if out.finish_reason == "error":
        return APIError(500 if out.server_fault else 400, out.error or "the request failed")
    return None
