"""Serving benchmark: requests arriving over time, replayed through each system in one run.

    python -m minillm bench serve --num-requests 128 --request-rate inf --max-concurrency 64 --json

A *workload* is a list of requests, each with a prompt (token ids), an output length and an
arrival time. Lengths come from a trace (`data/request_trace.jsonl`: prompt_tokens and
output_tokens per line), scaled so a run fits the machine; prompt ids are drawn at random
(seeded), as `vllm bench serve --dataset-name random` does; outputs are forced to their
length (ignore_eos), so every system does the same work. Arrivals are a Poisson process at
`rate` requests per second (`inf`: all at once); at most `max_concurrency` are in flight, a
new one is sent when one finishes (its latency counts from then, as a client's would).

Systems: the engine with `policy="continuous"`, the same engine with `policy="static"`, and
Hugging Face transformers with static batches of `max_concurrency` (padded `generate`, every
row runs until the longest is done). Metrics per system: completed / failed, duration,
output tokens per second, and TTFT, ITL, TPOT, end-to-end latency (mean, p50, p90, p99).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .timing import summarize
from ..sampling import SamplingParams

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "data" / "request_trace.jsonl"
SYSTEMS = ("continuous", "static", "transformers")


@dataclass(slots=True)
class WorkItem:
    request_id: str
    prompt_ids: list[int]
    output_len: int
    arrival_s: float          # seconds after the start of the run
    prompt: str | list | None = None   # over HTTP: text or chat messages instead of prompt_ids (bench_http.py)


@dataclass(slots=True)
class Record:
    """What one request saw. sent_s: seconds after the start of the run; the other times are
    seconds after it was sent."""
    output_tokens: int
    token_s: list[float]      # when each output token appeared
    finished: bool
    sent_s: float = 0.0
    queue_s: float = 0.0      # until its first token was scheduled (its prefill began)


@dataclass(slots=True)
class Replay:
    records: dict[str, Record]
    duration_s: float
    timeline: list[tuple[float, int, int, int, int]]   # after each step: (seconds, running, waiting, tokens in it,
                                                       # requests in it)
    prefix_cache_hit_rate: float | None = None     # prompt tokens found in the cache / looked up


def load_workload(path=None, num_requests: int = 128, length_scale: float = 0.6, max_prompt: int = 1024,
                  max_output: int = 512, request_rate: float = math.inf, vocab: tuple[int, int] = (1000, 40000),
                  seed: int = 0, shared_prefix_tokens: int = 0) -> list[WorkItem]:
    """The first `num_requests` lines of a trace, lengths x length_scale (clipped), random prompt ids.
    shared_prefix_tokens: every prompt starts with the same that many (random) tokens, as if all
    requests had one system prompt; the trace's length is what follows it."""
    path = Path(path) if path else DEFAULT_TRACE
    if not path.is_file():
        raise ValueError(f"workload file {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or not all({"prompt_tokens", "output_tokens"} <= set(r) for r in rows):
        raise ValueError(f"{path}: every line must be a JSON object with prompt_tokens and output_tokens")
    if num_requests < 1 or not 0 < length_scale <= 10 or not request_rate > 0 or shared_prefix_tokens < 0:
        raise ValueError("num_requests must be >= 1, length_scale in (0, 10], request_rate > 0 "
                         "and shared_prefix_tokens >= 0")
    rows = (rows * -(-num_requests // len(rows)))[:num_requests]
    rng = random.Random(seed)
    prefix = [rng.randrange(*vocab) for _ in range(shared_prefix_tokens)]
    t, items = 0.0, []
    for i, r in enumerate(rows):
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)          # Poisson arrivals: exponential gaps
        p = min(max(1, round(r["prompt_tokens"] * length_scale)), max_prompt)
        o = min(max(2, round(r["output_tokens"] * length_scale)), max_output)
        items.append(WorkItem(f"req-{i}", prefix + [rng.randrange(*vocab) for _ in range(p)], o, t))
    return items


def replay_engine(engine, items: list[WorkItem], max_concurrency: int | None = None,
                  timeout_s: float = 1800.0, progress: bool = True, ignore_eos: bool = True) -> Replay:
    """Send the requests at their arrival times and step the engine until all finish (or timeout_s:
    what is left is aborted and counted as failed). ignore_eos: every answer runs to its output_len (the
    same work for every system); False: to its end of text, up to output_len."""
    pending = deque(sorted(items, key=lambda w: w.arrival_s))
    records, sent, timeline, in_flight = {}, {}, [], 0
    before = engine.stats()
    bar = tqdm(total=len(items), desc=engine.scheduler.policy, unit="req", disable=None if progress else True)
    t0 = time.perf_counter()
    while (pending or engine.has_unfinished_requests()) and time.perf_counter() - t0 < timeout_s:
        while pending and pending[0].arrival_s <= time.perf_counter() - t0 and \
                (max_concurrency is None or in_flight < max_concurrency):
            w = pending.popleft()    # its latency counts from now (arrival_time defaults to the present)
            engine.add_request(w.request_id, w.prompt_ids, SamplingParams(max_tokens=w.output_len, ignore_eos=ignore_eos))
            sent[w.request_id] = time.perf_counter() - t0
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0].arrival_s - (time.perf_counter() - t0))))
            continue
        outs = engine.step()
        st = engine.stats()
        timeline.append((time.perf_counter() - t0, st["running"], st["waiting"], st["tokens_last_step"],
                         len(batch.requests) if (batch := getattr(engine, "last_batch", None)) else st["running"]))
        for out in outs:
            if out.finished:
                m = out.metrics
                token_s = [m.ttft_s + sum(m.itl_s[:i]) for i in range(len(m.itl_s) + 1)] if m.ttft_s else []
                records[out.request_id] = Record(len(out.token_ids), token_s, out.finish_reason in ("length", "stop"),
                                                 sent[out.request_id], m.queue_s or 0.0)
                in_flight -= 1
                bar.update(1)
    duration = time.perf_counter() - t0
    bar.close()
    for w in items:
        if w.request_id not in records:
            engine.abort_request(w.request_id)
            records[w.request_id] = Record(0, [], False, sent.get(w.request_id, 0.0))
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hit_rate = (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if engine.config.enable_prefix_caching and queries else None
    return Replay(records, duration, timeline, hit_rate)


def replay_transformers(hf_model, items: list[WorkItem], batch_size: int, pad_id: int,
                        timeout_s: float = 1800.0, progress: bool = True) -> Replay:
    """Static batching as a transformers user does it: take up to batch_size requests that have
    arrived, left-pad them, `generate` until the longest output is done, then the next batch.
    Token times come from a streamer (one call per step for the whole batch); a request's tokens
    after its own length are computed but thrown away."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):     # first call: the prompts; then once per step
            self.times.append(time.perf_counter())

        def end(self):
            pass

    pending = deque(sorted(items, key=lambda w: w.arrival_s))
    records, timeline = {}, []
    bar = tqdm(total=len(items), desc="transformers", unit="req", disable=None if progress else True)
    t0 = time.perf_counter()
    while pending and time.perf_counter() - t0 < timeout_s:
        wait = pending[0].arrival_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter() - t0
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_s <= now:
            batch.append(pending.popleft())
        sent = [t0 + max(w.arrival_s, 0.0) for w in batch]
        width = max(len(w.prompt_ids) for w in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, w in enumerate(batch):
            ids[i, width - len(w.prompt_ids):] = torch.tensor(w.prompt_ids)
            mask[i, width - len(w.prompt_ids):] = 1
        n = max(w.output_len for w in batch)
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            dev = hf_model.device
            hf_model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad_id, streamer=clock)
        steps = clock.times[1:]
        for w, s in zip(batch, sent):
            records[w.request_id] = Record(w.output_len, [t - s for t in steps[:w.output_len]], True,
                                           s - t0, started - s)
        timeline.append((time.perf_counter() - t0, len(batch), len(pending), len(batch), len(batch)))
        bar.update(len(batch))
    duration = time.perf_counter() - t0
    bar.close()
    for w in items:
        records.setdefault(w.request_id, Record(0, [], False))
    return Replay(records, duration, timeline)


def summarize_system(system: str, replay: Replay) -> dict:
    records, duration = replay.records, replay.duration_s
    done = [r for r in records.values() if r.finished and r.token_s]
    ttft = [r.token_s[0] for r in done]
    itl = [b - a for r in done for a, b in zip(r.token_s, r.token_s[1:])]
    tpot = [(r.token_s[-1] - r.token_s[0]) / (len(r.token_s) - 1) for r in done if len(r.token_s) > 1]
    e2e = [r.token_s[-1] for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    return {"system": system, "completed": len(done), "failed": len(records) - len(done),
            "duration_s": duration, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / duration,
            "requests_per_s": len(done) / duration,
            "prefix_cache_hit_rate": replay.prefix_cache_hit_rate,
            "ttft_s": summarize(ttft), "itl_s": summarize(itl), "tpot_s": summarize(tpot), "e2e_s": summarize(e2e)}


def run_serve_bench(model, tokenizer, items: list[WorkItem], systems=("continuous", "static"),
                    hf_model=None, max_concurrency: int = 64, engine_options: dict | None = None,
                    timeout_s: float = 1800.0, progress: bool = True,
                    on_result=None) -> tuple[list[dict], dict[str, Replay]]:
    """Each system replays the same workload, one after the other. Returns a summary per system
    and the replays (per-request records and the step timeline), by system name. Each system first
    replays two tiny requests, untimed. on_result(summary) is called as each system finishes."""
    from ..engine import LLMEngine

    results, replays = [], {}
    for system in systems:
        if system == "transformers":
            if hf_model is None:
                raise ValueError("the transformers system needs hf_model (bench.load_transformers_peer())")
            pad = min(tokenizer.stop_ids)
            replay_transformers(hf_model, _tiny(items), max_concurrency, pad, progress=False)
            replay = replay_transformers(hf_model, items, max_concurrency, pad, timeout_s, progress)
        elif system in ("continuous", "static"):
            opts = {"max_num_seqs": max_concurrency, **(engine_options or {}), "policy": system}
            engine = LLMEngine(model, tokenizer, **opts)
            replay_engine(engine, _tiny(items), progress=False)
            replay = replay_engine(engine, items, max_concurrency, timeout_s, progress)
            del engine
        else:
            raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
        replays[system] = replay
        results.append(summarize_system(system, replay))
        if on_result:
            on_result(results[-1])
    return results, replays


def _tiny(items: list[WorkItem]) -> list[WorkItem]:
    """Two short requests: the first calls pay for lazy set-up; keep that out of the numbers."""
    return [WorkItem(f"warmup-{i}", [1000 + i] * 16, 4, 0.0) for i in range(2)]   # shares nothing with items


def long_prompt_interference(engine, background: list[list[int]], long_prompt: list[int],
                             background_tokens: int = 96, long_tokens: int = 8, arrive_step: int = 10,
                             max_steps: int = 20_000) -> dict:
    """Requests decoding, and a long prompt arriving among them (notebook 08, benchmarks/chunked_prefill.py).

    The `background` requests start together; at step `arrive_step` the long prompt arrives (with a small
    budget their prompts are still being computed in chunks then, and it waits behind them). Returns the
    background requests' inter-token latencies, the long prompt's TTFT, and every step's (end time,
    seconds, tokens, of which the long prompt's)."""
    bg = SamplingParams(max_tokens=background_tokens, ignore_eos=True)
    for i, p in enumerate(background):
        engine.add_request(f"bg{i}", p, bg)
    outs, steps, t0 = {}, [], time.perf_counter()
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        if step == arrive_step:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=long_tokens, ignore_eos=True))
        long_req = engine.requests.get("long")
        long_before = long_req.num_computed_tokens if long_req else 0
        start = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        end = time.perf_counter()
        long_now = long_req.num_computed_tokens if long_req else 0
        steps.append((end - t0, end - start, engine.tokens_last_step, long_now - long_before))
    itl = [gap for rid, o in outs.items() if rid != "long" for gap in o.metrics.itl_s]
    return {"itl_s": itl, "long_ttft_s": outs["long"].metrics.ttft_s if "long" in outs else None,
            "steps": steps, "background_itl": {rid: o.metrics.itl_s for rid, o in outs.items() if rid != "long"}}
