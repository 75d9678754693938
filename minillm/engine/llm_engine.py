"""LLMEngine: requests in, tokens out, one step at a time.

    engine = LLMEngine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=512)
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():          # a RequestOutput for each request that got a token or ended
            print(out.request_id, out.text)

A step is: the scheduler picks tokens to compute (scheduler.py), the runner computes them
in one forward pass (runner.py), and each request that reached its last token samples the
next one with its own parameters and random stream. One block pool, owned here, lives as
long as the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..generate import first_stop
from ..kv import BlockPool, kv_cache_bytes
from ..kv.quantized import check_kv_dtype
from ..kv.prefix_cache import PrefixCachingPool, chain_hashes
from ..sampling import SamplingParams, sample_next_token
from .request import Request, RequestMetrics, RequestOutput, Status
from .runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler
from .speculation import Speculator

logger = logging.getLogger("minillm")

DEFAULT_KV_CACHE_MEMORY = 1 << 30   # bytes: 1 GiB, 23,301 tokens of SmolLM2 in float32


class LLMEngine:
    def __init__(self, model, tokenizer, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 policy: str = "continuous", enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, attention: str = "auto", enable_prefix_caching: bool = True,
                 speculative=None, num_speculative_tokens: int = 4, kv_cache_dtype: str | None = "model",
                 verbose: bool = True):
        cfg = model.cfg
        kv_dtype = getattr(model, "kv_cache_dtype", None) if kv_cache_dtype == "model" else kv_cache_dtype
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = min(max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        if not enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                             f"raise it, lower max_model_len, or enable chunked prefill")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        check_kv_dtype(kv_dtype)
        block_bytes = kv_cache_bytes(cfg, block_size, model.dtype, kv_dtype)
        if num_blocks is None:
            num_blocks = (DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds no block: one block of {block_size} tokens takes {block_bytes} "
                             f"bytes; give kv_cache_memory >= {block_bytes} or num_blocks >= 1")
        pool_cls = PrefixCachingPool if enable_prefix_caching else BlockPool
        self.pool = pool_cls(cfg, num_blocks, block_size, model.dtype, model.device, kv_dtype)
        self.prefix_caching = enable_prefix_caching
        self.capacity_tokens = num_blocks * block_size
        self.max_len = min(self.max_model_len, self.capacity_tokens)   # longest request that can ever run
        self.runner = ModelRunner(model, self.pool, attention)
        self.speculator = None if speculative is None else Speculator(speculative, self.runner, num_speculative_tokens)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, policy, enable_chunked_prefill,
                                   prefix_caching=enable_prefix_caching, max_len=self.max_len,
                                   num_speculative_tokens=num_speculative_tokens if self.speculator else 0)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.tokens_last_step = 0
        self.num_steps = 0
        say = logger.info if verbose else logger.debug
        say("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s); %s batching, %d tokens and %d sequences "
            "per step; prefix caching %s; speculative decoding %s", num_blocks, block_size, self.capacity_tokens, num_blocks * block_bytes / 2**20,
            kv_dtype or str(model.dtype).removeprefix("torch."), policy, max_num_batched_tokens, max_num_seqs,
            "on" if enable_prefix_caching else "off",
            f"{self.speculator.proposer.name}, k={num_speculative_tokens}" if self.speculator else "off")

    # ------------------------------------------------------------ requests in
    def add_request(self, request_id, prompt_ids, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None, n: int = 1) -> list[str]:
        """Queue a request. Bad input raises ValueError for this request alone; nothing else changes.
        cache_salt: requests with different salts never share cached blocks (e.g. one per user).
        n > 1: n samples of one prompt. The prompt is computed once; when it is done the request forks
        into n that share its blocks (copy-on-write), ids request_id, request_id/1, ... (returned);
        with a seed, sample i uses seed + i."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
        if not isinstance(n, int) or not 1 <= n <= self.scheduler.max_num_seqs:
            raise ValueError(f"n must be an integer in [1, {self.scheduler.max_num_seqs}] (the engine runs at most "
                             f"max_num_seqs sequences at once); got {n!r}")
        ids = [request_id] + [f"{request_id}/{i}" for i in range(1, n)]
        if any(i in self.requests for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        prompt = self.check_prompt(prompt_ids)
        req = Request(request_id, prompt, params)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        req.decoder = self.tokenizer.stream_decoder()
        req.cache_salt = cache_salt
        req.forks = [(rid, params if params.seed is None else dataclasses.replace(params, seed=params.seed + i))
                     for i, rid in enumerate(ids[1:], 1)]
        self.requests[request_id] = req
        self.scheduler.add(req)
        return ids

    def check_prompt(self, prompt_ids) -> list[int]:
        """The prompt as a list of ints, or ValueError saying what is wrong with it (the server asks first)."""
        if isinstance(prompt_ids, str):
            raise ValueError("prompt_ids must be token ids, not text: tokenize it first (tokenizer.encode)")
        try:
            prompt = [int(t) for t in prompt_ids]
        except (TypeError, ValueError):
            raise ValueError("prompt_ids must be a list of integer token ids") from None
        vocab = self.model.cfg.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the context is {self.max_model_len}; "
                             f"shorten it to at most {self.max_model_len - 1} tokens")
        if len(prompt) >= self.capacity_tokens:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the whole KV cache holds "
                             f"{self.capacity_tokens}; shorten it or give the engine more kv_cache_memory")
        return prompt

    def abort_request(self, request_id) -> bool:
        """Stop a request now; its blocks go back to the pool at once. False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req)
        req.finish("abort")
        self._aborted.append(req)
        for rid, params in req.forks:                 # samples not forked yet end with it
            kid = Request(rid, req.prompt_token_ids, params)
            kid.finish("abort")
            self._aborted.append(kid)
        req.forks = []
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or aborted ones not yet reported by a step."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample. Returns an output for every request that got a
        token or finished in this step (aborted requests are reported at the next step)."""
        return self._execute(self.scheduler.schedule())

    def _execute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        outputs = [self._output(r) for r in self._aborted]
        self._aborted = []
        if self.speculator is not None:
            self.speculator.propose(batch)                                  # drafts after sampled tokens
        self.tokens_last_step = batch.total_tokens
        if not batch.requests:
            return self._forget(outputs)
        logits = self.runner.execute(batch)                                  # (M, vocab)
        now = time.perf_counter()
        self.num_steps += 1
        done, rows, row = [], [], 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            d = len(req.spec_token_ids)
            req.num_computed_tokens += n - d                                 # drafts count once accepted
            if req.num_computed_tokens == req.num_tokens:
                done.append(req)
                rows.append((row, 1 + d))
                for kid in self._fork(req) if req.forks else ():   # n > 1: the samples share the prompt
                    done.append(kid)
                    rows.append((row, 1))
                row += 1 + d
            else:
                self._register_full_blocks(req)
        plain = [i for i, r in enumerate(done) if not r.spec_token_ids]
        sampled = dict(zip(plain, self._sample(logits[[rows[i][0] for i in plain]], [done[i] for i in plain])))
        for i, req in enumerate(done):
            if i in sampled:
                new = [] if sampled[i] is None else [sampled[i]]
            else:
                start, m = rows[i]
                new = self.speculator.verify(req, logits[start:start + m])
                req.num_computed_tokens += len(new) - 1                      # the accepted drafts' K/V stay
            if self.pool.lengths[req.request_id] > req.num_computed_tokens:  # rejected drafts, unused room
                self.pool.truncate(req.request_id, req.num_computed_tokens)
            for j, token in enumerate(new):
                kept = len(req.output_token_ids)
                self._append(req, token, now)
                if req.logprobs is not None and len(req.output_token_ids) > kept:
                    req.logprobs.append(_logprobs(logits[rows[i][0] + j], token, req.params.logprobs))
                if req.finished:
                    break
            self._register_full_blocks(req)
            if req.finished:
                self.scheduler.finish(req)
            outputs.append(self._output(req))
        return self._forget(outputs)

    def _fork(self, parent: Request) -> list[Request]:
        """The prompt of an n > 1 request is computed: its samples start, sharing every block of it."""
        kids = []
        for rid, params in parent.forks:
            kid = Request(rid, parent.prompt_token_ids, params, arrival_time=parent.arrival_time)
            kid.decoder, kid.cache_salt = self.tokenizer.stream_decoder(), parent.cache_salt
            kid.first_scheduled_time, kid.status = parent.first_scheduled_time, Status.RUNNING
            kid.num_computed_tokens, kid.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens
            kid.block_hashes, kid.num_hashed_blocks = list(parent.block_hashes), parent.num_hashed_blocks
            self.pool.fork(parent.request_id, rid)             # no copy: the blocks' refcounts go up
            self.scheduler.running.append(kid)
            self.requests[rid] = kid
            kids.append(kid)
        parent.forks = []
        return kids

    def _register_full_blocks(self, req: Request) -> None:
        """Blocks that are now full of computed K/V become findable by content (prompt and answer alike,
        so a chat's next turn finds its history)."""
        if not self.prefix_caching:
            return
        bs = self.pool.block_size
        full = min(req.num_computed_tokens, req.num_tokens) // bs    # (tokens after an accepted EOS are not kept)
        if full <= req.num_hashed_blocks:
            return
        tokens = req.token_slice(0, full * bs)
        req.block_hashes = chain_hashes(tokens, bs, req.cache_salt, req.block_hashes)
        table = self.pool.tables[req.request_id]
        for j in range(req.num_hashed_blocks, full):
            self.pool.register(table[j], req.block_hashes[j], tokens[j * bs:(j + 1) * bs])
        req.num_hashed_blocks = full

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int | None]:
        """Greedy rows in one argmax; sampled rows each with their own parameters and generator.
        A row that fails (say, NaN logits) ends its request with finish_reason "error"; the rest go on."""
        tokens: list[int | None] = [None] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
                tokens[i] = t
        for i, r in enumerate(reqs):
            if not r.params.greedy:
                try:
                    tokens[i] = int(sample_next_token(logits[i:i + 1], r.params, r.generator)[0])
                except RuntimeError as e:
                    r.error = f"sampling failed: {e}"
                    r.finish("error")
        return tokens

    def _append(self, req: Request, token: int, now: float) -> None:
        """Record a sampled token; finish the request on a stop token, a stop string, or its length."""
        p = req.params
        req.token_times.append(now)
        if not p.ignore_eos and token in self.tokenizer.stop_ids:
            req.text += req.decoder.flush()
            req.finish("stop", now)
            return
        req.output_token_ids.append(token)
        before = len(req.text)
        req.text += req.decoder.push(token)
        if p.stop:
            longest = max(map(len, p.stop))
            cut = first_stop(req.text[max(0, before - longest + 1):], p.stop)
            if cut >= 0:
                req.text = req.text[:max(0, before - longest + 1) + cut]
                req.finish("stop", now)
                return
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_len:
            req.text += req.decoder.flush()
            req.finish("length", now)

    def _output(self, req: Request) -> RequestOutput:
        text = req.text
        if not req.finished and req.params.stop:   # hold back what could be the start of a stop string
            text = text[:max(0, len(text) - max(map(len, req.params.stop)) + 1)]
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), text, req.finished,
                             req.finish_reason, RequestMetrics.of(req), req.num_preemptions, req.error,
                             req.num_cached_tokens, None if req.logprobs is None else list(req.logprobs))

    def _forget(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        s, pool, sp = self.scheduler, self.pool, self.speculator
        return {"running": len(s.running), "waiting": len(s.waiting), "num_preemptions": s.num_preemptions,
                "kv_blocks_used": pool.num_blocks - pool.num_free_blocks, "kv_blocks_total": pool.num_blocks,
                "tokens_last_step": self.tokens_last_step, "num_steps": self.num_steps,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "prefix_cache_evictions": getattr(pool, "num_evictions", 0),
                "spec_drafts": sp.num_drafts if sp else 0, "spec_draft_tokens": sp.num_draft_tokens if sp else 0,
                "spec_accepted_tokens": sp.num_accepted_tokens if sp else 0}


def _logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits (vocab,) -> the token's log-probability under the model (before temperature and filters,
    as vLLM reports it) and the `top` most likely (id, log-probability)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = lp.topk(top) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if top else []
    return float(lp[token]), pairs
