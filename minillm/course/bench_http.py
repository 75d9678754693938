"""Load-test any OpenAI-compatible server over HTTP, the way `vllm bench serve` does.

    python -m minillm bench serve --url http://127.0.0.1:8000 --request-rate 4 --num-requests 64

Each request is sent at its arrival time (Poisson at `rate`, or all at once), at most
`max_concurrency` in flight, with `"stream": true`; the client reads the server-sent events as
they come. Per request, from the moment it is sent:

    TTFT   until the first chunk that carries text
    ITL    the gaps between chunks that carry text (a chunk may carry several tokens)
    E2E    until the last one
    TPOT   (E2E - TTFT) / (chunks - 1)

and for the run: requests and output tokens per second (completed ones over the run's duration).

A request that fails (an HTTP error, a stream that breaks before a finish_reason or `[DONE]`, the
run's time limit) is counted as failed
and left out of the latencies. Results have the same shape as the in-process engine benchmark
(bench_serve.summarize_system), so the two can be put side by side.

Workloads: the trace of bench_serve (random token ids, fixed output lengths with ignore_eos: the
same work on every server that accepts token ids, as minillm and vLLM do), or a .jsonl of text
prompts ({"prompt": ...} or {"messages": [...]} per line, with "max_tokens") for any server.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path

from tqdm import tqdm

from .bench_serve import Record, Replay, WorkItem


def load_text_workload(path, num_requests: int = 64, max_tokens: int = 64, request_rate: float = math.inf,
                       seed: int = 0, start: int = 0) -> list[WorkItem]:
    """Text prompts from a .jsonl file: {"prompt": str} or {"messages": [...]} per line, optional "max_tokens";
    from line `start` on (wrapping round), so that runs one after another can send different prompts."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"workload file {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or not all(isinstance(r, dict) and ("prompt" in r or "messages" in r) for r in rows):
        raise ValueError(f"{path}: every line must be a JSON object with 'prompt' (text) or 'messages'")
    rows = rows[start % len(rows):] + rows[:start % len(rows)]
    rows = (rows * -(-num_requests // len(rows)))[:num_requests]
    rng, t, items = random.Random(seed), 0.0, []
    for i, r in enumerate(rows):
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        items.append(WorkItem(f"req-{i}", [], int(r.get("max_tokens", max_tokens)), t,
                              r.get("messages") or r["prompt"]))
    return items


class MetricsSampler:
    """Reads a minillm server's /metrics every `interval_s` while a run goes on (a thread): the
    running and waiting requests and KV-cache use over time, to explain the latencies."""

    def __init__(self, url: str, interval_s: float = 0.25):
        self.url, self.interval_s = url.rstrip("/") + "/metrics", interval_s
        self.samples: list[tuple[float, float, float, float]] = []   # (seconds, running, waiting, kv usage)
        self._stop = None

    def __enter__(self):
        import threading

        import httpx

        self._stop = threading.Event()
        t0 = time.perf_counter()

        def loop():
            names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            while not self._stop.wait(self.interval_s):
                try:
                    lines = httpx.get(self.url, timeout=5).text.splitlines()
                except httpx.HTTPError:
                    continue
                got = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(names)}
                self.samples.append((time.perf_counter() - t0, *(got.get(n, 0.0) for n in names)))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def _body(w: WorkItem, model: str, chat: bool, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": w.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    prompt = w.prompt if w.prompt is not None else w.prompt_ids
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else \
            [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one(client, url: str, body: dict, headers: dict, t0: float) -> Record:
    sent = time.perf_counter()
    times, tokens, ok = [], 0, False
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Record(0, [], False, sent - t0)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                ok = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                break
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", tokens)
            for c in chunk.get("choices") or []:
                piece = c.get("text") or (c.get("delta") or {}).get("content")
                if piece:
                    times.append(time.perf_counter() - sent)
                ok = ok or bool(c.get("finish_reason"))     # some servers end without [DONE]
    return Record(tokens or len(times), times, ok and bool(times), sent - t0)


async def replay_http(url: str, items: list[WorkItem], model: str | None = None, chat: bool = False,
                      max_concurrency: int | None = None, ignore_eos: bool = True, api_key: str | None = None,
                      timeout_s: float = 1800.0, progress: bool = True) -> Replay:
    """Send the workload to a server; returns every request's Record (as bench_serve's replays do)."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(items)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        if model is None:
            try:
                r = await client.get(f"{base}/v1/models", headers=headers)
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise ValueError(f"no OpenAI-compatible server answers at {base}/v1/models ({e}); "
                                 f"is it running, and is --url right?") from None
        endpoint = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
        gate = asyncio.Semaphore(limit)
        bar = tqdm(total=len(items), desc="requests", unit="req", disable=None if progress else True)
        t0 = time.perf_counter()

        async def send(w: WorkItem) -> Record:
            await asyncio.sleep(max(0.0, w.arrival_s - (time.perf_counter() - t0)))
            async with gate:
                try:
                    return await _one(client, endpoint, _body(w, model, chat, ignore_eos), headers, t0)
                except (httpx.HTTPError, json.JSONDecodeError):
                    return Record(0, [], False, time.perf_counter() - t0)
                finally:
                    bar.update(1)

        tasks = {w.request_id: asyncio.create_task(send(w)) for w in items}
        done, late = await asyncio.wait(tasks.values(), timeout=timeout_s)
        for t in late:                               # over the time limit: counted as failed
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        duration = time.perf_counter() - t0
        bar.close()
    records = {rid: t.result() if t in done else Record(0, [], False) for rid, t in tasks.items()}
    return Replay(records, duration, [])


def run_http_bench(url: str, items: list[WorkItem], **kwargs) -> Replay:
    """replay_http from synchronous code: a script, the CLI, or a notebook (whose event loop is
    already running: the run gets a thread and a loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_http(url, items, **kwargs))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, replay_http(url, items, **kwargs)).result()
