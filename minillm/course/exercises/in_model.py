"""Exercises whose answer runs inside the real model: the check is the model's own greedy tokens.

    check_attention_in_model    notebook 01: the learner's causal attention for one head, in every head of
                                every layer of the naive loop (stage 1)
    check_online_tile_in_model  notebook 05: the learner's online-softmax tile step, in a tiled attention that
                                runs every head of every layer of the naive loop (stage 1)
    check_kv_append_in_model    notebook 03: the learner's cache append, in every layer, at the prompt and
                                at every decode step (stage 2)
    check_schedule_in_engine    notebook 07: the learner's scheduler step deciding every step of an
                                `LLMEngine` (admission, chunks, preemption) while the model runs
    check_verify_in_engine      notebook 10: the learner's greedy verification deciding which drafts an
                                engine with n-gram speculation keeps

The learner's function replaces the model's own piece; the model then generates greedily from a prompt,
and each token must be the reference's (the stage's own tokens, made earlier in the notebook). The first
token that differs is printed with both texts. Like the other checks, these never raise.
"""
from __future__ import annotations

import torch

from ...attention import sdpa_attention
from ...engine import LLMEngine
from ...engine.request import Status
from ...engine.scheduler import ScheduledBatch, Scheduler
from ...stages import NaiveRunner
from .check import learner_failed


def _greedy_match(step, prompt_ids: list[int], reference: list[int], tok, what: str) -> bool:
    """step(ids) -> logits (vocab,) of the token after ids (the prompt first, then one token per call).
    Greedy tokens until they leave the reference or reach its length; True if all are the reference's."""
    got: list[int] = []
    try:
        with torch.inference_mode():
            logits = step(list(prompt_ids))
            for want in reference:
                got.append(int(logits.argmax()))
                if got[-1] != want or len(got) == len(reference):
                    break
                logits = step([got[-1]])
    except Exception as e:                                   # the learner's bug: show where
        return learner_failed(e, what, "inside the model, raised")
    if got == list(reference):
        print(f"✓ {what}, inside the model: its {len(got)} greedy tokens are the reference's, token for token:"
              f"\n  {tok.decode(got)!r}")
        return True
    i = len(got) - 1
    print(f"✗ {what}, inside the model: token {i} is {tok.decode([got[i]])!r}, the reference's is "
          f"{tok.decode([reference[i]])!r}\n  yours:     {tok.decode(got)!r}\n  reference: {tok.decode(reference[:i + 1])!r}")
    return False


def _every_head(fn):
    """The model's attention function from fn(q, k, v) of one head, (T, hd) each: q (B, H, T, hd) and
    k, v (B, n_kv, T, hd) -> (B, H, T, hd), each query head with its group's key/value head."""
    def attn(q, k, v, mask=None):
        B, H = q.shape[:2]
        group = H // k.shape[1]                                 # query heads per key/value head
        return torch.stack([torch.stack([fn(q[b, h], k[b, h // group], v[b, h // group]) for h in range(H)])
                            for b in range(B)])                 # (B, H, T, hd)
    return attn


def check_attention_in_model(fn, model, prompt_ids: list[int], reference: list[int], tok) -> bool:
    """fn(q, k, v) -> (T, hd): causal attention for one head, run as every head of every layer of the naive
    loop; its greedy tokens from prompt_ids must be `reference` (the naive stage's own)."""
    runner = NaiveRunner(model, attn_fn=_every_head(fn))

    def step(ids):                                  # the prompt, then one token a call
        return runner.decode(ids[0]) if runner.seqs else runner.prefill(ids)
    return _greedy_match(step, prompt_ids, reference, tok, "your causal attention")


def check_online_tile_in_model(fn, model, prompt_ids: list[int], reference: list[int], tok, block: int = 16) -> bool:
    """fn(m, l, acc, s, v): one key tile of the online softmax, driving a tiled attention (blocks of `block`
    queries and keys) in every head of every layer of the naive loop; its greedy tokens must be `reference`."""
    from .flash import tiled_with
    runner = NaiveRunner(model, attn_fn=tiled_with(fn, block))

    def step(ids):
        return runner.decode(ids[0]) if runner.seqs else runner.prefill(ids)
    return _greedy_match(step, prompt_ids, reference, tok, "your online-softmax tile")


class _YourCache:
    """Stage 2's attention context with the learner's append: one sequence, a preallocated K and V per
    layer, (1, n_kv, max_len, hd); SDPA over what the append returns."""

    def __init__(self, model, max_len: int, append):
        cfg = model.cfg
        shape = (1, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layers)]
        self.append, self.start = append, 0

    def attend(self, layer: int, q, k, v):
        k_all, v_all = self.append(self.k[layer], self.v[layer], k, v, self.start)   # (1, n_kv, start + T, hd)
        return sdpa_attention(q, k_all, v_all)                                       # (1, H, T, hd)


def check_kv_append_in_model(fn, model, prompt_ids: list[int], reference: list[int], tok) -> bool:
    """fn(k_cache, v_cache, k, v, start) -> (k_all, v_all), used by every layer to store the prompt's K/V and
    then each decode step's; the greedy tokens from prompt_ids must be `reference` (stage 1's)."""
    cache = _YourCache(model, len(prompt_ids) + len(reference), fn)

    def step(ids):
        T = len(ids)
        positions = torch.arange(cache.start, cache.start + T, device=model.device)          # (T,)
        logits = model(torch.tensor([ids], device=model.device), positions, cache,
                       logit_indices=torch.tensor([T - 1], device=model.device))            # (1, 1, vocab)
        cache.start += T
        return logits[0, -1]
    return _greedy_match(step, prompt_ids, reference, tok, "your KV append")


class _YourScheduler(Scheduler):
    """The engine's scheduler with the learner's step deciding: the state goes out as plain data
    (running (name, computed, left), waiting (name, left)), the decision comes back and is carried out
    with the scheduler's own moves (`_preempt`, `_admit`, `_start`: the pool changes only through them)."""

    your_step = None

    def schedule(self) -> ScheduledBatch:
        named = {r.request_id: r for r in [*self.running, *self.waiting]}
        running = [(r.request_id, r.num_computed_tokens, r.num_tokens_to_compute) for r in self.running]
        waiting = [(r.request_id, r.num_tokens) for r in self.waiting]
        scheduled, preempted = self.your_step(running, waiting, self.max_num_batched_tokens, self.max_num_seqs,
                                              self.kv.num_free_blocks, self.kv.block_size)
        batch = ScheduledBatch()
        for name in preempted:
            req = named[name]
            self.running.remove(req)
            self._preempt(req)
            batch.preempted.append(req)
        for name, n in scheduled:
            req = named[name]
            if req.status == Status.WAITING:                 # admitted now: it goes to the head, then runs
                self.waiting.remove(req)
                self.waiting.appendleft(req)
                self._admit([])
            self._start(req, n, batch)                       # raises if the pool has no room for n tokens
        return batch


def check_schedule_in_engine(fn, model, tok, prompts: list[list[int]], params, reference: list[list[int]],
                             **engine_options) -> bool:
    """fn(running, waiting, budget, max_seqs, free_blocks, block_size) -> (scheduled, preempted) decides every
    step of an LLMEngine (no prefix cache: the exercise leaves it out); a request arrives every second step.
    Each request's greedy tokens must be `reference`'s (the naive stage's)."""
    engine = LLMEngine(model, tok, enable_prefix_caching=False, verbose=False, **engine_options)
    engine.scheduler.__class__ = _YourScheduler
    engine.scheduler.your_step = fn
    finished, step = {}, 0
    try:
        with torch.inference_mode():
            while step < 2 * len(prompts) or engine.has_unfinished_requests():
                if step > 50 * sum(len(r) + len(p) for r, p in zip(reference, prompts)):
                    print("✗ your scheduler, driving the engine: the requests never finish (does a step schedule "
                          "nothing while requests wait?)")
                    return False
                if step % 2 == 0 and step // 2 < len(prompts):
                    engine.add_request(step // 2, prompts[step // 2], params)
                finished.update({o.request_id: o for o in engine.step() if o.finished})
                step += 1
    except Exception as e:
        return learner_failed(e, "your scheduler", "driving the engine, led to")
    stats = engine.stats()
    wrong = [i for i in range(len(prompts)) if i not in finished or finished[i].token_ids != reference[i]]
    if wrong:
        i = wrong[0]
        got = finished[i].token_ids if i in finished else []
        print(f"✗ your scheduler, driving the engine: request {i} answered {tok.decode(got)!r}, "
              f"the reference {tok.decode(reference[i])!r}")
        return False
    print(f"✓ your scheduler drove the engine for {stats['num_steps']} steps ({stats['num_preemptions']} "
          f"preemptions): all {len(prompts)} requests got the reference's tokens, and the pool is empty again: "
          f"{stats['kv_blocks_used'] == 0}")
    return stats["kv_blocks_used"] == 0


def check_verify_in_engine(fn, llm, prompts: list[list[int]], params, reference: list[list[int]], tok) -> bool:
    """fn(draft_ids, target_argmax) -> emitted tokens, as the verification of `llm`'s engine (built with a
    proposer); greedy answers to `prompts` must be `reference`'s (plain decoding's)."""
    spec = llm.engine.speculator
    drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    spec.greedy_rule = lambda drafts, argmax: list(fn(list(drafts), list(argmax)))
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as e:
        return learner_failed(e, "your verification", "inside the engine, raised")
    finally:
        del spec.greedy_rule                                   # the engine's own rule again
    for i, (out, want) in enumerate(zip(outs, reference)):
        if out.token_ids != want:
            print(f"✗ your verification, inside the engine: request {i} answered {tok.decode(out.token_ids)!r}, "
                  f"plain decoding {tok.decode(want)!r}")
            return False
    print(f"✓ your verification kept {spec.num_accepted_tokens - accepted} of the "
          f"{spec.num_draft_tokens - drafted} drafts in the engine, and all {len(prompts)} answers are plain "
          f"decoding's, token for token")
    return True
