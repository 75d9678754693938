"""A request's whole state, and what the engine reports about it.

There are no "prefill" and "decode" phases here, only tokens still to compute:

    all tokens   = prompt + output so far
    computed     = num_computed_tokens: how many of them have K/V in the pool
    to compute   = all tokens - computed

A new request has its whole prompt to compute; a running one has 1 (the token it
just sampled); a request in chunked prefill has the rest of its prompt; a preempted
one has lost its K/V and must compute prompt + output again. The scheduler only
ever asks "how many tokens to compute?", so one rule covers all of them.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..detokenizer import IncrementalDetokenizer
from ..sampling import SamplingParams, make_generator

if TYPE_CHECKING:                                # for the types only: neither is imported at run time
    from ..speculative.adaptive import AdaptiveK
    from ..structured import Constraint


class Status(enum.Enum):
    WAITING = "waiting"     # in the queue: new, or preempted and to be recomputed
    RUNNING = "running"     # holds blocks in the pool; scheduled every step it fits
    FINISHED = "finished"   # see finish_reason


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None                    # what went wrong, for finish_reason "error"
    server_fault: bool = False                  # the error is the server's (the model step, sampling), not the request's
    output: IncrementalDetokenizer | None = None   # its tokens, text and stop rule (detokenizer.py)
    num_computed_tokens: int = 0
    num_reported_tokens: int = 0                # output tokens already in a RequestOutput
    # monotonic timestamps (time.perf_counter): arrival, first scheduled, each new token, finish
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None    # its own random stream: same seed, same tokens in any batch
    # prefix caching (kv/prefix_cache.py)
    cache_salt: str | None = None               # extra key in the first block's address: caches kept apart
    block_hashes: list[bytes] = field(default_factory=list)   # content addresses of its full blocks so far
    num_cached_tokens: int = 0                  # prompt tokens found in the cache at its (last) admission
    num_hashed_blocks: int = 0                  # its first blocks that are registered in the cache
    # speculative decoding (engine/speculation.py): this step's drafts after the sampled token
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None      # (drafts, vocab) the draft's distributions; None: one-hot
    spec_control: AdaptiveK | None = None       # adaptive speculation: how many drafts this request makes
    # params.logprobs set: per output token (its log-probability, [(id, log-probability)] of the best ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # params.prompt_logprobs set: the same per prompt token, None for the first (nothing comes before it)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # params.grammar set: its parser state (structured.Constraint), which says what may come next
    constraint: Constraint | None = None
    # n > 1: the sibling requests forked off this one once its prompt is computed (made with it, waiting)
    forks: list[Request] = field(default_factory=list)

    def __post_init__(self):
        if not self.params.greedy:
            self.generator = make_generator(self.params.seed)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def output_token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode needs one token)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P:end - P]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, now: float | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.status, self.finish_reason = Status.FINISHED, reason
        self.finish_time = time.perf_counter() if now is None else now


@dataclass(slots=True)
class RequestMetrics:
    """vLLM's definitions, in seconds:

    queue_s   arrival -> first scheduled
    ttft_s    arrival -> first token (time to first token)
    itl_s     gaps between consecutive tokens (inter-token latencies)
    tpot_s    (e2e - ttft) / (tokens - 1): time per output token after the first
    e2e_s     arrival -> finish (end to end)
    """
    queue_s: float | None
    ttft_s: float | None
    itl_s: list[float]
    tpot_s: float | None
    e2e_s: float | None

    @classmethod
    def of(cls, r: Request, num_times: int, finish_time: float | None) -> "RequestMetrics":
        """r's metrics as they stood after its first num_times tokens (finished at finish_time, or not yet)."""
        t = r.token_times[:num_times]
        queue = None if r.first_scheduled_time is None else r.first_scheduled_time - r.arrival_time
        ttft = t[0] - r.arrival_time if t else None
        e2e = None if finish_time is None else finish_time - r.arrival_time
        tpot = (e2e - ttft) / (len(t) - 1) if e2e is not None and ttft is not None and len(t) > 1 else None
        return cls(queue, ttft, [b - a for a, b in zip(t, t[1:])], tpot, e2e)


NO_METRICS = RequestMetrics(None, None, [], None, None)


@dataclass(slots=True)
class RequestOutput:
    """What a request produced in one step, and in all so far.

    new_token_ids, new_text (and new_logprobs): what is new since the request's last output (a delta:
    the cost of an output does not grow with the answer). token_ids, text, logprobs and metrics: the
    whole answer so far, built only when read. Text never ends in half a character or in what could
    be the start of a stop string.
    """
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_preemptions: int = 0
    error: str | None = None
    num_cached_tokens: int = 0     # prompt tokens whose K/V came from the prefix cache
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None   # see Request.logprobs
    # the request and where it stood: outputs, logprobs and token times only ever grow, so a prefix is fixed
    _request: Request | None = None
    _num_tokens: int = 0
    _text: str = ""
    _text_len: int = 0
    _num_times: int = 0
    _finish_time: float | None = None
    server_fault: bool = False     # finish_reason "error" by the server's fault (an HTTP 500), not the request's

    @classmethod
    def of(cls, r: Request, new_tokens: int, new_text: str) -> "RequestOutput":
        """r now, its last new_tokens tokens and new_text being new."""
        out, n = r.output, len(r.output.token_ids)
        new_lp = None if r.logprobs is None else r.logprobs[len(r.logprobs) - new_tokens:]
        return cls(r.request_id, r.prompt_token_ids, out.token_ids[n - new_tokens:], new_text, r.finished,
                   r.finish_reason, r.num_preemptions, r.error, r.num_cached_tokens, new_lp,
                   r, n, out.text, out.visible_len if not r.finished else len(out.text), len(r.token_times),
                   r.finish_time, r.server_fault)

    @classmethod
    def failed(cls, request_id: str, prompt_token_ids: list[int], reason: str, message: str,
               server_fault: bool = False) -> "RequestOutput":
        """A request that ends before it runs (refused, or the server stopping): no tokens."""
        return cls(request_id, prompt_token_ids, [], "", True, reason, error=message, server_fault=server_fault)

    @property
    def token_ids(self) -> list[int]:
        return [] if self._request is None else self._request.output_token_ids[:self._num_tokens]

    @property
    def text(self) -> str:
        return self._text[:self._text_len]

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        if self._request is None or self._request.logprobs is None:
            return None
        return self._request.logprobs[:self._num_tokens]

    @property
    def prompt_logprobs(self) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """params.prompt_logprobs set: each prompt token's (log-probability, best alternatives), None for
        the first; complete from the request's first token on."""
        return None if self._request is None else self._request.prompt_logprobs

    @property
    def metrics(self) -> RequestMetrics:
        if self._request is None:
            return NO_METRICS
        return RequestMetrics.of(self._request, self._num_times, self._finish_time)
