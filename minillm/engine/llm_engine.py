"""LLMEngine: requests in, tokens out, one step at a time.

    engine = LLMEngine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=512)
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():          # a RequestOutput for each request that got a token or ended
            print(out.request_id, out.new_text)

A step is six calls (`step`): the scheduler picks the tokens to compute (scheduler.py), the
speculator proposes drafts (speculation.py, when on), the runner computes everything in one forward
pass (runner.py), each request that reached its last token samples with its own parameters and
random stream, the scheduler applies the results, and the outputs say what is new. The block pool
lives as long as the engine; only the KV-cache manager (kv/manager.py) changes it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from ..detokenizer import IncrementalDetokenizer
from ..kv import BlockPool, kv_cache_bytes
from ..kv.manager import KVCacheManager
from ..kv.prefix_cache import PrefixCachingPool
from ..kv.quantized import check_kv_dtype
from ..sampling import SamplingParams, check_vocab, penalize, sample_next_token
from ..speculative.adaptive import speculation_settings
from ..structured import Constraint, allocate_bitmask, fill_bitmasks, mask_bias
from .request import Request, RequestOutput
from .runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler
from .speculation import Speculator

logger = logging.getLogger("minillm")

DEFAULT_KV_CACHE_MEMORY = 1 << 30   # bytes: 1 GiB, 23,301 tokens of SmolLM2 in float32


@dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine is built with, besides the model and tokenizer (vLLM's names)."""
    max_num_seqs: int = 64                  # sequences in one step
    max_num_batched_tokens: int = 512       # tokens in one step (prompt chunks and decodes)
    block_size: int = 16                    # tokens per KV block
    num_blocks: int | None = None           # KV blocks; None: as many as kv_cache_memory holds
    kv_cache_memory: int | None = None      # bytes for the KV cache; None: DEFAULT_KV_CACHE_MEMORY
    policy: str = "continuous"              # or "static" (the baseline)
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None        # None: the model's context
    attention: str = "auto"                 # "cpu" (C kernel), "torch" (gathered pages + SDPA), "triton"; auto: triton on a GPU, else cpu where it builds
    enable_prefix_caching: bool = True
    speculative: object = None              # a proposer: "ngram", "layers:N", "draft:q4", "ngram+draft:q4", a Proposer
    num_speculative_tokens: int | None = None   # the most drafts a step: None is 8 adaptive, 4 fixed
    adaptive_speculation: bool | None = None   # each request drafts 0..k a step where it pays (speculative/
                                               # adaptive.py); None: on with a proposer, False: k every step
    kv_cache_dtype: str | None = None       # None (the model's dtype), "int8", "int4"
    enforce_eager: bool = False             # no CUDA graphs for decode steps (they are captured on a GPU only)
    verbose: bool = True                    # log the KV cache's size at INFO level


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, runner_cls=ModelRunner,
                 **options):
        """config, or its fields as keywords. runner_cls(model, kv, attention): what runs the
        step's forward pass (a tensor-parallel leader passes one that also drives the other ranks;
        a simulation one that computes nothing)."""
        self.config = c = dataclasses.replace(config or EngineConfig(), **options)
        cfg = model.cfg
        kv_dtype = c.kv_cache_dtype
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = min(c.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        if not c.enable_chunked_prefill and c.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                             f"({c.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                             f"raise it, lower max_model_len, or enable chunked prefill")
        if c.block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {c.block_size}")
        check_kv_dtype(kv_dtype)
        block_bytes = kv_cache_bytes(cfg, c.block_size, model.dtype, kv_dtype)
        num_blocks = c.num_blocks
        if num_blocks is None:
            num_blocks = (DEFAULT_KV_CACHE_MEMORY if c.kv_cache_memory is None else c.kv_cache_memory) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds no block: one block of {c.block_size} tokens takes {block_bytes} "
                             f"bytes; give kv_cache_memory >= {block_bytes} or num_blocks >= 1")
        pool_cls = PrefixCachingPool if c.enable_prefix_caching else BlockPool
        pool = pool_cls(cfg, num_blocks, c.block_size, model.dtype, model.device, kv_dtype)
        self.kv = KVCacheManager(pool, log_copies=getattr(runner_cls, "needs_kv_copies", False))
        self.capacity_tokens = num_blocks * c.block_size
        self.max_len = min(self.max_model_len, self.capacity_tokens)   # longest request that can ever run
        self.runner = runner_cls(model, self.kv, c.attention)
        self.graph_capture_s = self._capture_decode_graphs() if self._graphs_apply() else None
        adaptive, k = speculation_settings(c.speculative, c.adaptive_speculation, c.num_speculative_tokens)
        self.speculator = None if c.speculative is None else Speculator(c.speculative, self.runner, k, adaptive)
        self.scheduler = Scheduler(self.kv, c.max_num_seqs, c.max_num_batched_tokens, c.policy,
                                   c.enable_chunked_prefill, max_len=self.max_len,
                                   num_speculative_tokens=k if self.speculator else 0,
                                   draft=self.speculator.draft if self.speculator else None)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.last_batch: ScheduledBatch | None = None
        self.tokens_last_step = 0
        self.num_steps = 0
        say = logger.info if c.verbose else logger.debug
        say("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s); %s batching, %d tokens and %d sequences "
            "per step; prefix caching %s; speculative decoding %s", num_blocks, c.block_size, self.capacity_tokens,
            num_blocks * block_bytes / 2**20, kv_dtype or str(model.dtype).removeprefix("torch."), c.policy,
            c.max_num_batched_tokens, c.max_num_seqs, "on" if c.enable_prefix_caching else "off",
            f"{self.speculator.proposer.name}, k{'<=' if adaptive else '='}{k}"
            if self.speculator else "off")

    def _graphs_apply(self) -> bool:
        """CUDA graphs for decode steps: on a GPU, with the Triton kernels and a float KV cache, unless
        enforce_eager (a tensor-parallel or simulated runner has none)."""
        c = self.config
        return (not c.enforce_eager and self.pool.device.type == "cuda" and c.kv_cache_dtype is None
                and hasattr(self.runner, "use_decode_graphs") and self.runner.attention == "triton")

    def _capture_decode_graphs(self) -> float:
        t0 = time.perf_counter()
        self.runner.use_decode_graphs(self.config.max_num_seqs, self.max_len)
        seconds = time.perf_counter() - t0
        logger.info("CUDA graphs for decode batches of %s captured in %.1f s (--enforce-eager: none)",
                    ", ".join(map(str, self.runner.graphs.sizes)), seconds)
        return seconds

    @property
    def pool(self) -> BlockPool:
        """The block pool, to look at (it changes through `self.kv` only)."""
        return self.kv.pool

    # ------------------------------------------------------------ requests in
    def add_request(self, request_id, prompt_ids, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None, n: int = 1) -> list[str]:
        """Queue a request. Bad input raises ValueError for this request alone; nothing else changes.
        cache_salt: requests with different salts never share cached blocks (e.g. one per user).
        n > 1: n samples of one prompt. The prompt is computed once; when it is done the request forks
        into n that share its blocks (copy-on-write), ids request_id, request_id/1, ... (returned);
        with a seed, sample i uses seed + i (wrapped into a generator's 64 bits)."""
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
        check_vocab(params, self.model.cfg.vocab_size)
        if params.max_tokens == 0 and n != 1:
            raise ValueError("scoring a prompt (max_tokens=0) has one answer: n must be 1")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        forks = [self._new_request(rid, prompt, params if params.seed is None else
                                   dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63),
                                   arrival_time=arrival, cache_salt=cache_salt)
                 for i, rid in enumerate(ids[1:], 1)]
        req = self._new_request(request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt, forks=forks)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return ids

    def _new_request(self, request_id, prompt: list[int], params: SamplingParams, **fields) -> Request:
        detok = IncrementalDetokenizer(self.tokenizer, params, min(params.max_tokens, self.max_len - len(prompt)))
        constraint = None if params.grammar is None else Constraint(params.grammar, self.tokenizer)
        return Request(request_id, prompt, params, output=detok, constraint=constraint, **fields)

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
        for kid in req.forks:                         # samples not forked yet end with it
            kid.finish("abort")
            self._aborted.append(kid)
        req.forks = []
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or aborted ones not yet reported by a step."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, propose, execute, sample, update. Returns an output for every request that got a
        token or finished in this step (aborted requests are reported at the next step)."""
        outputs = [self._output(r) for r in self._aborted]
        self._aborted = []
        batch = self.last_batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.propose(batch)                              # drafts after sampled tokens
        self.tokens_last_step = batch.total_tokens
        if batch.requests:
            try:
                t0 = time.perf_counter()
                logits = self.runner.execute(batch)                     # (len(batch.logit_rows), vocab)
                _score_prompts(batch, logits)
                sampled = self._sample(batch, logits)
                if self.speculator is not None:
                    self.speculator.observe(batch.total_tokens, time.perf_counter() - t0)
            except Exception as e:       # a fault in the model's step: its batch ends, the engine goes on
                logger.exception("the model step failed; its %d requests end with an error", len(batch.requests))
                return self._forget(outputs + self._fail(batch, e))
            for req in self.scheduler.update_from_output(batch, sampled):
                self.requests.setdefault(req.request_id, req)           # (a sample forked off in this step)
                outputs.append(self._output(req))
            self.num_steps += 1
        return self._forget(outputs)

    def _fail(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """End every request of a step that raised, with finish_reason "error" and the exception (the
        fault cannot be pinned on one of them); their blocks go back. The waiting requests go on."""
        message = f"the model step failed: {type(error).__name__}: {error}"
        outputs = []
        for req in batch.requests:
            if req.finished:
                continue
            self.scheduler.finish(req)
            for r in [req, *req.forks]:              # (samples not forked yet end with it)
                r.error, r.server_fault = message, True
                r.finish("error")
                outputs.append(self._output(r))
            req.forks = []
        return outputs

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[tuple[list[int], list | None]]:
        """For each of batch.samples: its new tokens (drafts verified: the accepted ones and one more)
        and, if asked for, their logprobs. Greedy rows in one argmax; sampled rows each with their own
        parameters and generator. A row that fails (say, NaN logits) ends its request with
        finish_reason "error" and no tokens; the rest go on."""
        samples = batch.samples
        tokens: list[list[int]] = [[] for _ in samples]
        plain = [i for i, (r, _, m) in enumerate(samples) if m == 1]
        # rows with penalties, a bias or a grammar, changed (the logprobs are still the model's own, as vLLM's)
        changed = {i: penalize(logits[samples[i][1]], r.params, r.prompt_token_ids, r.output_token_ids)[None]
                   for i in plain if (r := samples[i][0]).params.sequential}
        constrained = [i for i in plain if samples[i][0].constraint is not None]
        if constrained:
            bias = self._grammar_masks([samples[i][0] for i in constrained], logits)   # (C, vocab): 0 or -inf
            for k, i in enumerate(constrained):
                changed[i] = changed[i] + bias[k]
        greedy = [i for i in plain if samples[i][0].params.greedy and i not in changed]
        if greedy:                 # every row's argmax: cheaper than copying the greedy rows out first
            best = logits.argmax(dim=-1).tolist()
            for i in greedy:
                tokens[i] = [best[samples[i][1]]]
        for i in plain:
            r, row, _ = samples[i]
            if r.finished:                                   # (no token the grammar allows)
                continue
            if not r.params.greedy or i in changed:
                try:
                    row_logits = changed[i] if i in changed else logits[row:row + 1]
                    tokens[i] = [int(sample_next_token(row_logits, r.params, r.generator)[0])]
                except RuntimeError as e:
                    r.error, r.server_fault = f"sampling failed: {e}", True
                    r.finish("error")
        for i in constrained:
            r = samples[i][0]
            if tokens[i] and not r.constraint.accept(tokens[i][0]):
                r.error = f"the grammar refused the token it allowed: {r.constraint.error}"
                r.finish("error")
        for i, (r, row, m) in enumerate(samples):
            if m > 1:
                tokens[i] = self.speculator.verify(r, logits[row:row + m])
        return [(new, None if r.logprobs is None else
                 [_logprobs(logits[row + j], t, r.params.logprobs) for j, t in enumerate(new)])
                for new, (r, row, _) in zip(tokens, samples)]

    def _grammar_masks(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """(len(reqs), vocab) logit biases: 0 for the tokens each request's grammar allows next, -inf for
        the rest. A request whose grammar allows nothing (its parser failed) ends with finish_reason "error"."""
        vocab = self.model.cfg.vocab_size
        bitmask = allocate_bitmask(len(reqs), vocab)                   # (R, ceil(vocab / 32)) int32
        fill_bitmasks([r.constraint for r in reqs], bitmask)
        bias = mask_bias(bitmask.to(logits.device), vocab, logits.dtype)
        for r, any_ok in zip(reqs, bitmask.ne(0).any(dim=-1).tolist()):
            if not any_ok:
                r.error = f"the grammar allows no next token: {r.constraint.error or 'its parser is stuck'}"
                r.finish("error")
        return bias

    def _output(self, req: Request) -> RequestOutput:
        """What is new since the request's last output (tokens, showable text), and where it stands."""
        new_text = req.output.take(everything=req.finished)
        new_tokens = len(req.output_token_ids) - req.num_reported_tokens
        req.num_reported_tokens = len(req.output_token_ids)
        return RequestOutput.of(req, new_tokens, new_text)

    def _forget(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        s, kv, pool, sp = self.scheduler, self.kv, self.pool, self.speculator
        return {"running": len(s.running), "waiting": len(s.waiting), "num_preemptions": s.num_preemptions,
                "kv_blocks_used": pool.num_blocks - pool.num_free_blocks, "kv_blocks_total": pool.num_blocks,
                "tokens_last_step": self.tokens_last_step, "num_steps": self.num_steps,
                "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits,
                "prefix_cache_evictions": getattr(pool, "num_evictions", 0),
                "spec_drafts": sp.num_drafts if sp else 0, "spec_draft_tokens": sp.num_draft_tokens if sp else 0,
                "spec_accepted_tokens": sp.num_accepted_tokens if sp else 0,
                "draft_kv_blocks_used": sp.draft.kv.pool.num_blocks - sp.draft.kv.num_free_blocks
                if sp and sp.draft else 0}


def _score_prompts(batch: ScheduledBatch, logits: torch.Tensor) -> None:
    """Append the log-probabilities of the prompt tokens this step's rows predict (batch.prompt_rows)
    to their requests' prompt_logprobs."""
    for req, row, m, pos in batch.prompt_rows:
        lp = torch.log_softmax(logits[row:row + m].float(), dim=-1)                   # (m, vocab)
        targets = torch.tensor(req.prompt_token_ids[pos:pos + m], device=lp.device)   # (m,)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = req.params.prompt_logprobs
        best = lp.topk(k, dim=-1) if k else None
        for j, v in enumerate(chosen):
            top = list(zip(best.indices[j].tolist(), best.values[j].tolist())) if k else []
            req.prompt_logprobs.append((v, top))


def _logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits (vocab,) -> the token's log-probability under the model (before temperature and filters,
    as vLLM reports it) and the `top` most likely (id, log-probability)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = lp.topk(top) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if top else []
    return float(lp[token]), pairs
