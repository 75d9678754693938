"""The scheduler: which requests compute how many tokens in the next step.

Every step hands out a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`):

1. Running requests first, oldest admission first. A decode costs one token; a
   request still in its prompt gets the next chunk of it (chunked prefill), as much
   as the budget has left. Prefill chunks and decodes of different requests share the
   step: a long prompt no longer stalls everyone else's next token.
2. If a running request needs a block and the pool has none, the most recently
   admitted running request is **preempted**: its blocks are freed, it goes back to the
   front of the queue, and later it recomputes prompt + output so far (its output does
   not change). Nothing new is admitted in that step.
3. Then waiting requests, in arrival order (first come, first served: when the head of
   the queue does not fit, nobody behind it jumps ahead), each admitted only if the
   blocks for its tokens of this step fit in the pool.

With prefix caching on (a `PrefixCachingPool`), admission first looks up the longest chain of the
request's full blocks already in the cache, takes those blocks and counts their tokens as computed;
only the rest is scheduled. At least the last prompt token is always computed (its logits are
needed), and a cached block is never written: when every block hits, the last one is recomputed.

With speculative decoding (`num_speculative_tokens` = k > 0), a decoding request is given room for
1 + k tokens: its sampled token and up to k drafts, proposed after scheduling and verified in the
same pass (`engine/speculation.py`). Drafts count against the budget like any token; they shrink to
fit the budget, the request's max_tokens and the context, and to nothing before they would cost a
preemption.

After the step's forward pass and sampling, `update_from_output` applies the results: it alone moves
`num_computed_tokens`, forks the samples of an n > 1 request when its prompt is done, accepts drafts
or rolls them back, appends the new tokens and finishes requests. Blocks change only through the
KV-cache manager (`kv/manager.py`).

`policy="static"` is the baseline: admit a whole batch (up to `max_num_seqs` whose
tokens fit the pool) when nothing is running, run it until its last request ends, and
only then admit the next. The slots of finished requests stay empty meanwhile: the
*bubble* that continuous batching fills.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv.manager import KVCacheManager
from .request import Request, Status

POLICIES = ("continuous", "static")


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: requests[i] computes num_new_tokens[i] tokens, starting at its
    num_computed_tokens (the scheduler has already made room for them in the pool)."""
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_spec_slots: list[int] = field(default_factory=list)   # of num_new_tokens, room for drafts
    preempted: list[Request] = field(default_factory=list)
    _rows: tuple | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int, spec: int = 0) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.num_spec_slots.append(spec)

    def set_drafts(self, i: int, drafts: int) -> None:
        """The one hand-off from the speculator (`engine/speculation.py`), after scheduling and before
        anything reads the rows: request i computes its sampled token and `drafts` of the slots the
        scheduler gave it (fewer than its room when the proposer found fewer, or adaptive speculation
        chose fewer). The slots it leaves stay allocated and are overwritten next step."""
        if self._rows is not None:
            raise RuntimeError("the batch's rows were already planned: drafts are set before logit_rows is read")
        if not 0 <= drafts <= self.num_spec_slots[i]:
            raise ValueError(f"request {i} has room for {self.num_spec_slots[i]} drafts, not {drafts}")
        self.num_new_tokens[i] = 1 + drafts

    @property
    def logit_rows(self) -> list[int]:
        """Which of the step's packed tokens need logits: for each request whose tokens are all computed
        after this step, its last token, or with drafts, its sampled token and each draft."""
        return self._plan()[0]

    @property
    def samples(self) -> list[tuple[Request, int, int]]:
        """(request, first row, rows) of the logits for every request that samples in this step; the
        samples of an n > 1 request whose prompt ends here share its row."""
        return self._plan()[1]

    @property
    def prompt_rows(self) -> list[tuple[Request, int, int, int]]:
        """(request, first row, rows, first prompt position they predict) for requests that want their
        prompt's log-probabilities: a prompt token's row gives the next prompt token's."""
        return self._plan()[2]

    def _plan(self) -> tuple:
        """Computed once, on first use (after the drafts are set: `set_drafts`)."""
        if self._rows is None:
            rows, samples, prompt, packed = [], [], [], 0
            for req, n in zip(self.requests, self.num_new_tokens):
                d, start = len(req.spec_token_ids), req.num_computed_tokens
                if req.prompt_logprobs is not None:     # rows of prompt positions not yet scored
                    lo, hi = max(start, len(req.prompt_logprobs) - 1), min(start + n, len(req.prompt_token_ids) - 1)
                    if hi > lo:
                        prompt.append((req, len(rows), hi - lo, lo + 1))
                        rows += range(packed + lo - start, packed + hi - start)
                packed += n
                if start + n - d == req.num_tokens and req.params.max_tokens:
                    samples.append((req, len(rows), 1 + d))
                    samples += [(kid, len(rows), 1) for kid in req.forks]
                    rows += range(packed - 1 - d, packed)
            self._rows = (rows, samples, prompt)
        return self._rows


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", enable_chunked_prefill: bool = True,
                 num_speculative_tokens: int = 0, max_len: int | None = None, draft=None):
        """draft: a draft model's cache (draft.py), freed with a request's own blocks."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1; "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.kv, self.policy, self.draft = kv, policy, draft
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.num_speculative_tokens = num_speculative_tokens
        self.max_len = max_len or kv.pool.num_blocks * kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in order of admission
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue changes
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Take a request out of the queues and give back its blocks (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.policy == "static" and not self.running:
            self._admit_static_batch()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._tokens_for(req, budget)
            if n == 0:
                i += 1
                continue
            spec = self._spec_slots(req, n, budget)
            if spec:
                self._start(req, 1 + spec, batch, spec)
                budget -= 1 + spec
                i += 1
                continue
            while not self.kv.can_append(req, n):
                victim = self.running.pop()                  # the most recently admitted
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._start(req, n, batch)
                budget -= n
                i += 1
                continue
            break                                            # req itself was preempted: nobody after it runs
        if self.policy == "continuous" and not batch.preempted:
            while self.waiting and budget > 0 and self._room_for(self.waiting[0]):
                req = self.waiting[0]
                cached = self.kv.computed_blocks(req)
                n = self._tokens_for(req, budget, len(cached) * self.kv.block_size)
                if n == 0 or self.kv.blocks_to_admit(req, cached, n) > self.kv.num_free_blocks:
                    break                                    # first come, first served: no overtaking
                self._admit(cached)
                self._start(req, n, batch)
                budget -= n
        return batch

    # ------------------------------------------------------------ helpers
    def _room_for(self, req: Request) -> bool:
        """Whether req fits under max_num_seqs, counting the samples each n > 1 request forks into once
        its prompt is done (they run as sequences of their own)."""
        running = sum(1 + len(r.forks) for r in self.running)
        return running + 1 + len(req.forks) <= self.max_num_seqs

    def _tokens_for(self, req: Request, budget: int, cached: int | None = None) -> int:
        """Tokens `req` computes this step: all it has left, or (chunked prefill) what the budget allows.
        Without chunking a prompt goes whole or waits for a step with room for it."""
        n = req.num_tokens_to_compute if cached is None else req.num_tokens - cached
        if n <= budget:
            return n
        return budget if self.chunked else 0

    def _spec_slots(self, req: Request, n: int, budget: int) -> int:
        """Room for drafts after a decoding request's sampled token: at most k, within the budget, the
        request's max_tokens and the context, and only while the pool has the blocks without preempting."""
        if not self.num_speculative_tokens or n != 1 or not req.output_token_ids or req.params.sequential:
            return 0                           # (penalties, grammars: each token's logits depend on the one before)
        spec = min(self.num_speculative_tokens, budget - 1,
                   req.params.max_tokens - len(req.output_token_ids) - 1, self.max_len - req.num_tokens - 1)
        while spec > 0 and not self.kv.can_append(req, 1 + spec):
            spec -= 1
        return max(spec, 0)

    def _start(self, req: Request, n: int, batch: ScheduledBatch, spec: int = 0) -> None:
        self.kv.append(req, n)                               # room for the n new tokens' K/V
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        batch.add(req, n, spec)

    def _preempt(self, req: Request) -> None:
        """Free the blocks; recompute prompt + output later. The output so far is kept."""
        self._free(req)
        req.status, req.num_computed_tokens = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.draft is not None:
            self.draft.free(req)

    def _admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs requests from the queue whose whole
        prompts (and outputs so far) fit in the free blocks; they run until the last ends."""
        free = self.kv.num_free_blocks
        while self.waiting and self._room_for(self.waiting[0]):
            req = self.waiting[0]
            cached = self.kv.computed_blocks(req)
            need = self.kv.blocks_to_admit(req, cached, req.num_tokens - len(cached) * self.kv.block_size)
            if need > free and self.running:
                break
            free -= need
            self._admit(cached)

    def _admit(self, cached: list[int]) -> None:
        """The head of the queue starts running, holding `cached` (its prefix found in the cache)."""
        req = self.waiting.popleft()
        req.num_computed_tokens = req.num_cached_tokens = self.kv.admit(req, cached)
        req.status = Status.RUNNING
        self.running.append(req)

    # ------------------------------------------------------------ after the step
    def update_from_output(self, batch: ScheduledBatch,
                           sampled: list[tuple[list[int], list | None]]) -> list[Request]:
        """Apply a step: sampled[i] = (new tokens, their logprobs or None) of batch.samples[i] (for a
        request with drafts: the accepted drafts and one more token). Returns the requests that got
        tokens or finished, in batch order (the samples of an n > 1 request after it)."""
        now = time.perf_counter()
        result = {id(req): s for (req, _, _), s in zip(batch.samples, sampled)}
        advanced = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n - len(req.spec_token_ids)     # drafts count once accepted
            if req.num_computed_tokens < req.num_tokens:                # a prompt chunk: nothing sampled
                self.kv.cache_full_blocks(req)
                continue
            if not req.params.max_tokens:                             # scored, nothing to generate
                req.finish("length", now)
                self.finish(req)
                advanced.append(req)
                continue
            kids = self._fork(req) if req.forks else []
            for r in [req, *kids]:
                self._accept(r, *result[id(r)], now)
                advanced.append(r)
        return advanced

    def _fork(self, parent: Request) -> list[Request]:
        """The prompt of an n > 1 request is computed: its samples start, sharing every block of it."""
        kids, parent.forks = parent.forks, []
        for kid in kids:
            kid.first_scheduled_time, kid.status = parent.first_scheduled_time, Status.RUNNING
            kid.num_computed_tokens, kid.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens
            if parent.prompt_logprobs is not None:      # one prompt, scored once: every sample reports it
                kid.prompt_logprobs = parent.prompt_logprobs
            self.kv.fork(parent, kid)
            self.running.append(kid)
        return kids

    def _accept(self, req: Request, new: list[int], logprobs, now: float) -> None:
        """req's new tokens: keep the accepted drafts' K/V and forget the rest, append the tokens until
        the request ends (its detokenizer says when), cache the blocks now full, finish it."""
        if req.spec_token_ids:
            req.num_computed_tokens += len(new) - 1                  # the accepted drafts' K/V stay
            req.spec_token_ids, req.spec_probs = [], None
        self.kv.truncate(req, req.num_computed_tokens)               # rejected drafts, unused room
        for j, token in enumerate(new):
            kept = len(req.output_token_ids)
            req.token_times.append(now)
            req.output.push(token)
            if logprobs is not None and len(req.output_token_ids) > kept:
                req.logprobs.append(logprobs[j])
            if req.output.done:
                req.finish(req.output.finish_reason, now)
                break
        self.kv.cache_full_blocks(req)
        if req.finished:
            self.finish(req)
