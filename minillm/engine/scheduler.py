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

`policy="static"` is the baseline: admit a whole batch (up to `max_num_seqs` whose
tokens fit the pool) when nothing is running, run it until its last request ends, and
only then admit the next. The slots of finished requests stay empty meanwhile: the
*bubble* that continuous batching fills.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import BlockPool
from ..kv.prefix_cache import chain_hashes
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

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int, spec: int = 0) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.num_spec_slots.append(spec)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", enable_chunked_prefill: bool = True, prefix_caching: bool = False,
                 num_speculative_tokens: int = 0, max_len: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1; "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.pool, self.policy = pool, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.prefix_caching = prefix_caching
        self.num_speculative_tokens = num_speculative_tokens
        self.max_len = max_len or pool.num_blocks * pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in order of admission
        self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0     # tokens looked up / found

    # ------------------------------------------------------------ queue changes
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Take a request out of the queues and give back its blocks (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
            self.pool.free_seq(req.request_id)
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
            while not self.pool.can_append(req.request_id, n):
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
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                cached = self._cached_prefix(req)
                n = self._tokens_for(req, budget, len(cached) * self.pool.block_size)
                if n == 0 or self._blocks_to_admit(req, cached, n) > self.pool.num_free_blocks:
                    break                                    # first come, first served: no overtaking
                self._admit(cached)
                self._start(req, n, batch)
                budget -= n
        return batch

    # ------------------------------------------------------------ helpers
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
        if not self.num_speculative_tokens or n != 1 or not req.output_token_ids:
            return 0
        spec = min(self.num_speculative_tokens, budget - 1,
                   req.params.max_tokens - len(req.output_token_ids) - 1, self.max_len - req.num_tokens - 1)
        while spec > 0 and not self.pool.can_append(req.request_id, 1 + spec):
            spec -= 1
        return max(spec, 0)

    def _start(self, req: Request, n: int, batch: ScheduledBatch, spec: int = 0) -> None:
        self.pool.grow(req.request_id, n)                    # room for the n new tokens' K/V
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        batch.add(req, n, spec)

    def _preempt(self, req: Request) -> None:
        """Free the blocks; recompute prompt + output later. The output so far is kept."""
        self.pool.free_seq(req.request_id)
        req.status, req.num_computed_tokens = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs requests from the queue whose whole
        prompts (and outputs so far) fit in the free blocks; they run until the last ends."""
        free = self.pool.num_free_blocks
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self._cached_prefix(req)
            need = self._blocks_to_admit(req, cached, req.num_tokens - len(cached) * self.pool.block_size)
            if need > free and self.running:
                break
            free -= need
            self._admit(cached)

    def _admit(self, cached: list[int]) -> None:
        """The head of the queue starts running, holding `cached` (its prefix found in the cache)."""
        req = self.waiting.popleft()
        self.pool.allocate(req.request_id, 0)
        if cached:
            self.pool.share(req.request_id, cached)
        bs = self.pool.block_size
        req.num_computed_tokens = req.num_cached_tokens = len(cached) * bs
        req.num_hashed_blocks = len(cached)
        if self.prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += len(cached) * bs
        req.status = Status.RUNNING
        self.running.append(req)

    def _cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the cache holding the longest prefix of req's tokens, at most all but the block
        of its last token (that one is computed: its logits are needed, and cached blocks are never written)."""
        if not self.prefix_caching:
            return []
        bs, tokens = self.pool.block_size, req.all_token_ids
        usable = (len(tokens) - 1) // bs
        req.block_hashes = chain_hashes(tokens[:usable * bs], bs, req.cache_salt, req.block_hashes)
        return self.pool.lookup(req.block_hashes[:usable], tokens)

    def _blocks_to_admit(self, req: Request, cached: list[int], n: int) -> int:
        """Free blocks that admitting req with `cached` and computing n tokens takes."""
        held = len(cached) * self.pool.block_size
        new = self.pool.blocks_for(held + n) - len(cached)
        return new + (self.pool.blocks_to_reuse(cached) if cached else 0)
