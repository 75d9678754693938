"""The scheduler without the model: what each step would compute, in no time.

`simulate(prompt_lens, output_lens, ...)` runs the real `Scheduler` and block pool with a
runner that computes nothing (every request simply gets its output length), and records
every step: which requests it served and how many tokens each. Arrivals are counted in
steps. It shows the shape of a schedule — the static bubble, chunked prompts, preemptions —
and, with a cost per step measured on a machine (`decode_step_times`, `prefill_step_times` and their medians),
predicts how long the real run will take (`predicted_seconds`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..config import ModelConfig
from ..sampling import SamplingParams
from ..engine.llm_engine import LLMEngine
from .timing import require_warmup


@dataclass(slots=True)
class SimStep:
    tokens: dict[str, int]        # request id -> tokens computed in this step
    running: int
    waiting: int
    preempted: int


class _NullRunner:
    """Returns logits that pick token 1 for every request that samples; computes nothing."""

    def __init__(self, model, kv, attention):
        self.vocab = model.cfg.vocab_size

    def execute(self, batch):
        logits = torch.zeros(len(batch.logit_rows), self.vocab)
        logits[:, 1] = 1.0
        return logits


class _NullTokenizer:
    stop_ids: set = set()

    def stream_decoder(self):
        return SimpleNamespace(push=lambda token: "", flush=lambda: "")


def simulate(prompt_lens: list[int], output_lens: list[int], arrival_steps: list[int] | None = None,
             cfg: ModelConfig | None = None, max_steps: int = 100_000, **engine_options) -> list[SimStep]:
    """Steps of the schedule for requests with these lengths (ids "0", "1", ...), arriving at
    the given steps (default: all at step 0). engine_options: LLMEngine's (policy, max_num_seqs, ...)."""
    cfg = cfg or ModelConfig()
    model = SimpleNamespace(cfg=cfg, dtype=torch.float32, device=torch.device("meta"))   # a pool of no memory
    engine_options.setdefault("kv_cache_memory", 1 << 30)
    engine_options.setdefault("enable_prefix_caching", False)      # the stand-in prompts are all alike
    engine = LLMEngine(model, _NullTokenizer(), verbose=False, runner_cls=_NullRunner, **engine_options)
    arrivals = arrival_steps or [0] * len(prompt_lens)
    order = sorted(range(len(prompt_lens)), key=lambda i: arrivals[i])
    steps: list[SimStep] = []
    nxt = 0
    while (nxt < len(order) or engine.has_unfinished_requests()) and len(steps) < max_steps:
        while nxt < len(order) and arrivals[order[nxt]] <= len(steps):
            i = order[nxt]
            engine.add_request(str(i), [1] * prompt_lens[i], SamplingParams(max_tokens=output_lens[i], ignore_eos=True))
            nxt += 1
        preempted = engine.stats()["num_preemptions"]
        engine.step()
        batch, st = engine.last_batch, engine.stats()
        steps.append(SimStep({r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)},
                             st["running"], st["waiting"], st["num_preemptions"] - preempted))
    return steps


def decode_step_times(model, tokenizer, batch: int, context: int = 100, steps: int = 8, warmup: int = 3) -> list[float]:
    """Seconds of each of `steps` engine steps in which `batch` requests (prompts of `context` tokens) each
    decode one token, after `warmup` such steps untimed (the first ones after a large prompt step run slower)."""
    block = 16
    engine = LLMEngine(model, tokenizer, block_size=block, max_num_seqs=max(batch, 1), verbose=False,
                       num_blocks=batch * -(-(context + warmup + steps + 4) // block),   # room for all at once,
                       max_num_batched_tokens=max(512, batch * context))      # and their prompts in one step
    for i in range(batch):
        engine.add_request(i, [1000 + i] * context, SamplingParams(max_tokens=warmup + steps + 4, ignore_eos=True))
    for _ in range(batch * context + 1):                    # until every prompt is done
        engine.step()
        if engine.stats()["tokens_last_step"] == batch:
            break
    else:
        raise RuntimeError(f"{batch} requests never decoded in one step")
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def decode_step_seconds(model, tokenizer, batch: int, context: int = 100, steps: int = 8) -> float:
    """Median of `decode_step_times`."""
    return statistics.median(decode_step_times(model, tokenizer, batch, context, steps))


def prefill_step_times(model, tokenizer, tokens: int, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` engine steps that compute one prompt of `tokens` tokens (an empty cache),
    after `warmup` (at least 1) untimed ones (the first step of a process also pays for one-time set-up)."""
    require_warmup(warmup)
    times = []
    for n in range(warmup + repeats):
        engine = LLMEngine(model, tokenizer, max_num_batched_tokens=max(512, tokens), kv_cache_memory=256 << 20,
                           verbose=False)
        engine.add_request(0, [1000 + i % 500 for i in range(tokens)], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        engine.step()
        if n >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def prefill_step_seconds(model, tokenizer, tokens: int, repeats: int = 3) -> float:
    """Median of `prefill_step_times`."""
    return statistics.median(prefill_step_times(model, tokenizer, tokens, repeats))


def predicted_seconds(steps: list[SimStep], cost_tokens: list[int], cost_seconds: list[float]) -> float:
    """A simulated schedule priced step by step: each step's time interpolated from measured
    (tokens in a step, seconds) points."""
    return sum(float(np.interp(sum(s.tokens.values()), cost_tokens, cost_seconds)) for s in steps)


def priced_steps(timeline: list[tuple], cost_tokens: list[int], cost_seconds: list[float]) -> dict[str, dict]:
    """A measured run's steps (a replay's timeline: seconds after each step, running, waiting, tokens in it,
    requests in it) against the same prices as `predicted_seconds`, in two kinds: decode-only steps (one token
    per request) and steps that carry prompt tokens. {kind: {"steps", "measured_s", "priced_s"}}."""
    out = {kind: {"steps": 0, "measured_s": 0.0, "priced_s": 0.0} for kind in ("decode only", "with a prompt")}
    before = 0.0
    for t, _running, _waiting, tokens, requests in timeline:
        if tokens:
            kind = out["decode only" if tokens == requests else "with a prompt"]
            kind["steps"] += 1
            kind["measured_s"] += t - before
            kind["priced_s"] += float(np.interp(tokens, cost_tokens, cost_seconds))
        before = t
    return out
