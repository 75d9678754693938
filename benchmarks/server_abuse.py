"""The server under abuse, measured: fuzzed from its own OpenAPI schema, offered ten times what it can serve,
and soaked under a mixed load with clients that hang up. Each part starts `python -m minillm serve` on a free
loopback port (the course model, float32), drives it for a bounded count and time, and stops it.

    python benchmarks/server_abuse.py fuzz --cases 2500          # schemathesis + hand-made bad bodies
    python benchmarks/server_abuse.py overload --requests 500    # a burst past --max-queued-requests
    python benchmarks/server_abuse.py soak --minutes 10          # ~80% of saturation, RSS and latency over time

Results go to results/cpu_server_abuse.json (one key per part, the machine named) and the soak's plot to
results/cpu_server_soak.png. tests/test_server_fuzz.py runs `fuzz` and `overload` small, in the test process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
ERROR_KEYS = {"message", "type", "param", "code"}


# ------------------------------------------------------------ fuzzing
def bad_bodies(model: str) -> list[tuple[str, bytes, str]]:
    """Bodies no schema generator writes: (what, bytes, content type). Each must get a 4xx, not a 500."""
    deep = 100_000
    return [
        ("empty", b"", "application/json"),
        ("not JSON", b"hello", "application/json"),
        ("cut short", b'{"model": "' + model.encode() + b'", "prompt": "Once', "application/json"),
        ("a JSON list", b"[1, 2, 3]", "application/json"),
        ("JSON null", b"null", "application/json"),
        ("nested 100,000 deep", b'{"model": "m", "prompt": ' + b"[" * deep + b"]" * deep + b"}", "application/json"),
        ("a huge number", b'{"model": "m", "prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json"),
        ("1e999", b'{"model": "m", "prompt": "Hi", "temperature": 1e999}', "application/json"),
        ("NaN", b'{"model": "m", "prompt": "Hi", "temperature": NaN}', "application/json"),
        ("a lone surrogate", b'{"model": "m", "prompt": "\\ud800"}', "application/json"),
        ("invalid UTF-8", b'{"model": "m", "prompt": "\xff\xfe"}', "application/json"),
        ("NUL bytes", b'{"model": "m", "prompt": "a\\u0000b"}', "application/json"),
        ("a key twice", b'{"model": "m", "model": 5, "prompt": "Hi"}', "application/json"),
        ("2 MiB", b'{"model": "m", "prompt": "' + b"a" * (2 << 20) + b'"}', "application/json"),
        ("form data", b"model=m&prompt=Hi", "application/x-www-form-urlencoded"),
        ("no content type", b'{"model": "m", "prompt": "Hi"}', ""),
    ]


def check_response(resp: httpx.Response | Exception | None, stream: bool) -> str | None:
    """None if the answer is one the API allows: a 4xx in OpenAI's error shape, or a 2xx that parses.
    Otherwise what is wrong with it."""
    if resp is None:
        return "no answer within the timeout (a hang)"
    if isinstance(resp, Exception):
        return f"the connection failed: {resp!r}"
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
        except Exception:
            return f"{resp.status_code} not in OpenAI's error shape: {resp.text[:300]}"
        if set(err) != ERROR_KEYS or not isinstance(err["message"], str) or not err["message"]:
            return f"{resp.status_code} error without its fields: {err}"
        return None
    kind = resp.headers.get("content-type", "")
    if kind.startswith("text/plain"):                   # /metrics
        return None
    if stream and kind.startswith("text/event-stream"):
        lines = [line for line in resp.text.splitlines() if line]
        if not lines or lines[-1] != "data: [DONE]":
            return f"a stream that does not end with [DONE]: {resp.text[-300:]}"
        for line in lines[:-1]:
            json.loads(line.removeprefix("data: "))
        return None
    try:
        resp.json()
    except ValueError:
        return f"a {resp.status_code} that is not JSON: {resp.text[:300]}"
    return None


def fuzz(url: str, model: str, cases: int, seed: int = 0, timeout_s: float = 60.0, progress=None) -> dict:
    """About `cases` requests against every route of the server at `url`: schemathesis's positive and negative
    cases from /openapi.json (the same number for each route and mode), then bad_bodies() on every POST route,
    then random bytes. Returns counts by status and the failures (a 5xx, a hang, a 4xx not in OpenAI's shape,
    /health not 200 afterwards). Sequential; every request has a timeout."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    statuses: dict[str, int] = {}
    by_op: dict[str, int] = {}
    failures: list[dict] = []
    client = httpx.Client(base_url=url, timeout=timeout_s)
    sent = 0

    def record(label: str, body, resp, stream: bool = False):
        nonlocal sent
        sent += 1
        k = label.split(":")[0] + " " + ("timeout" if resp is None else "dropped" if isinstance(resp, Exception) else str(resp.status_code))
        by_op[k] = by_op.get(k, 0) + 1
        key = "timeout" if resp is None else "dropped" if isinstance(resp, Exception) else str(resp.status_code)
        statuses[key] = statuses.get(key, 0) + 1
        problem = check_response(resp, stream)
        if problem is not None and len(failures) < 50:
            failures.append({"case": label, "body": repr(body)[:300], "problem": problem})
        if progress is not None:
            progress(sent)

    def send(method: str, path: str, content: bytes | None = None, headers: dict | None = None,
             params: dict | None = None):
        try:
            return client.request(method, path, content=content, headers=headers, params=params)
        except httpx.TimeoutException:
            return None
        except httpx.TransportError as e:       # the server closed the connection: as bad as a 500
            return e

    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    raw_share = len(POST_ROUTES) * (len(bad_bodies("m")) + 10)
    served_every = iter(range(1 << 30))
    rounds = 0
    while sent < cases - raw_share and rounds < 10:    # routes with nothing to vary give one case a round
        per_op = max(1, (cases - raw_share - sent) // (len(ops) * len(modes)))
        cfg = settings(max_examples=per_op, database=None, deadline=None, phases=[hypothesis.Phase.generate],
                       suppress_health_check=list(HealthCheck))
        for op in ops:
            for mode in modes:
                try:
                    strategy = op.as_strategy(generation_mode=mode)
                except Exception:           # negative cases of a route with no body and no parameters
                    continue

                @cfg
                @hypothesis.seed(seed + rounds)
                @given(strategy)
                def one(case):
                    kw = case.as_transport_kwargs(base_url=url)
                    body = kw.get("json", kw.get("data"))
                    if next(served_every) % 4 and isinstance(body, dict) and isinstance(body.get("model"), str):
                        body["model"] = model     # 3 cases in 4 name the served model, to reach the engine
                    content = json.dumps(body).encode() if "json" in kw else kw.get("data")
                    if isinstance(content, str):
                        content = content.encode()
                    headers = {k: v for k, v in (kw.get("headers") or {}).items()
                               if k.lower() in ("content-type", "authorization")}
                    if "json" in kw:
                        headers.setdefault("Content-Type", "application/json")
                    resp = send(kw["method"], kw["url"].removeprefix(url), content, headers, kw.get("params"))
                    record(f"{op.label} {mode}", body, resp,
                           stream=isinstance(body, dict) and body.get("stream") is True)

                try:
                    one()
                except hypothesis.errors.Unsatisfiable:
                    pass
        rounds += 1
    for route in POST_ROUTES:
        for what, content, ctype in bad_bodies("m"):
            record(f"POST {route}: {what}", content[:200], send("POST", route, content,
                                                                 {"Content-Type": ctype} if ctype else {}))

    @settings(max_examples=10, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @given(st.sampled_from(POST_ROUTES), st.binary(max_size=512))
    def random_bytes(route, content):
        record(f"POST {route}: random bytes", content, send("POST", route, content,
                                                             {"Content-Type": "application/json"}))

    for _ in POST_ROUTES:
        random_bytes()
    health = send("GET", "/health")
    if health is None or health.status_code != 200:
        failures.append({"case": "GET /health after the fuzzing", "body": None,
                         "problem": "no answer" if health is None else f"{health.status_code}: {health.text[:200]}"})
    client.close()
    return {"cases": sent, "statuses": dict(sorted(statuses.items())), "server_errors":
            sum(v for k, v in statuses.items() if not k.isdigit() or int(k) >= 500), "failures": failures,
            "by_case": by_op}


# ------------------------------------------------------------ overload
def read_metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value}, each series summed over its labels."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def settle(url: str, within_s: float = 60.0) -> float:
    """Seconds until the server runs nothing, queues nothing and holds no KV block (from /metrics)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        m = read_metrics(url)
        if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise RuntimeError(f"the server still works {within_s:.0f} s after its clients stopped: {read_metrics(url)}")


def overload(url: str, model: str, prompts: list[str], requests: int = 500, max_tokens: int = 12,
             timeout_s: float = 600.0) -> dict:
    """`requests` greedy completions sent at once (one connection each), cycling over `prompts`. Each must
    come back with the answer its prompt gets alone (asked first, one at a time) or be refused with a 503;
    none lost, none twice; then the pool is whole and the queue empty."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=timeout_s) as c:
        solo = {p: c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts}
    before = read_metrics(url)

    async def one(c: httpx.AsyncClient, prompt: str):
        try:
            r = await c.post("/v1/completions", json={**body, "prompt": prompt})
            return prompt, r.status_code, r.json()
        except httpx.HTTPError as e:
            return prompt, None, repr(e)

    async def burst():
        limits = httpx.Limits(max_connections=requests, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as c:
            return await asyncio.gather(*[one(c, prompts[i % len(prompts)]) for i in range(requests)])

    t0 = time.perf_counter()
    results = asyncio.run(burst())
    seconds = time.perf_counter() - t0
    served = [(p, r) for p, status, r in results if status == 200]
    refused = [r for _, status, r in results if status == 503]
    settled_s = settle(url)
    after = read_metrics(url)
    return {
        "requests": requests, "served": len(served), "refused_503": len(refused), "seconds": round(seconds, 1),
        "other": [(status, str(r)[:200]) for _, status, r in results if status not in (200, 503)][:10],
        "refusals_not_queue_full": sum(r["error"]["code"] != "queue_full" for r in refused),
        "not_the_solo_answer": sum(r["choices"][0]["text"] != solo[p] for p, r in served),
        "duplicate_ids": len(served) - len({r["id"] for _, r in served}),
        "preemptions": after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0),
        "settled_s": round(settled_s, 2), "kv_usage_after": after["vllm:kv_cache_usage_perc"],
        "waiting_after": after["vllm:num_requests_waiting"],
    }


# ------------------------------------------------------------ soak
def _questions() -> list[str]:
    path = Path(__file__).resolve().parent.parent / "data" / "chat_workload.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


async def _one_request(c: httpx.AsyncClient, model: str, rng: random.Random, hang_up: bool, t_start: float) -> dict:
    """One request of the mix: chat or completion, streamed or whole, n = 1..3, 16-64 tokens; hang_up: the
    client leaves mid-answer (a streamed one after 3 chunks, a whole one after 0.2-1 s)."""
    chat, stream, n = rng.random() < 0.5, rng.random() < 0.5, rng.randint(1, 3)
    question = rng.choice(_questions())
    body = {"model": model, "max_tokens": rng.randint(16, 64), "n": n, "stream": stream, "temperature": 0.7,
            "seed": rng.randrange(1 << 30), **({"messages": [{"role": "user", "content": question}]} if chat
                                               else {"prompt": question})}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    rec = {"t": time.perf_counter() - t_start, "stream": stream, "n": n, "hang_up": hang_up, "status": None,
           "ttft": None, "itl": []}
    t0 = time.perf_counter()
    try:
        if stream:
            async with c.stream("POST", route, json=body) as r:
                rec["status"], chunks, last = r.status_code, 0, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft"] = now - t0
                    elif n == 1:                    # (n > 1 interleaves its choices' chunks)
                        rec["itl"].append(now - last)
                    last, chunks = now, chunks + 1
                    if hang_up and chunks >= 3:
                        break
        elif hang_up:
            try:
                await asyncio.wait_for(c.post(route, json=body), timeout=rng.uniform(0.2, 1.0))
            except asyncio.TimeoutError:
                pass
        else:
            r = await c.post(route, json=body)
            rec["status"] = r.status_code
    except httpx.HTTPError as e:
        rec["status"] = repr(e)
    return rec


async def _closed_loop(url: str, model: str, workers: int, seconds: float, seed: int) -> float:
    """Requests per second the server completes with `workers` clients each sending the next as soon as the
    last is answered (no hang-ups): its saturation rate for this mix."""
    done, t_start = [], time.perf_counter()

    async def worker(i):
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() - t_start < seconds:
            rec = await _one_request(c, model, rng, False, t_start)
            done.append(rec["status"] == 200)

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await asyncio.gather(*[worker(i) for i in range(workers)])
    return sum(done) / (time.perf_counter() - t_start)


def soak(url: str, model: str, pid: int, minutes: float = 10.0, load: float = 0.8, hang_up: float = 0.1,
         seed: int = 0, saturation_s: float = 60.0, warmup_s: float = 60.0) -> dict:
    """Poisson arrivals at `load` x the saturation rate (measured first, closed loop at 32 clients) for
    `minutes`; a share `hang_up` of the clients leave mid-answer. The server's RSS is read every 5 s."""
    import psutil

    proc = psutil.Process(pid)
    saturation = asyncio.run(_closed_loop(url, model, 32, saturation_s, seed))
    rate = load * saturation
    settle(url)
    rss: list[tuple[float, int]] = []

    async def run():
        rng, tasks, t_start = random.Random(seed), [], time.perf_counter()
        limits = httpx.Limits(max_connections=1000)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
            next_rss = 0.0
            while (now := time.perf_counter() - t_start) < minutes * 60:
                if now >= next_rss:
                    rss.append((now, proc.memory_info().rss))
                    next_rss += 5
                tasks.append(asyncio.create_task(_one_request(c, model, rng, rng.random() < hang_up, t_start)))
                await asyncio.sleep(rng.expovariate(rate))
            records = await asyncio.gather(*tasks)
            rss.append((time.perf_counter() - t_start, proc.memory_info().rss))
            return records

    records = asyncio.run(run())
    settled_s = settle(url, within_s=120)
    after = read_metrics(url)
    rss.append((rss[-1][0] + settled_s, proc.memory_info().rss))
    kept = [r for r in records if not r["hang_up"]]
    warm = [b for t, b in rss if t >= warmup_s] or [rss[-1][1]]
    return {
        "minutes": minutes, "saturation_req_per_s": round(saturation, 3), "offered_req_per_s": round(rate, 3),
        "requests": len(records), "hung_up": len(records) - len(kept),
        "served": sum(r["status"] == 200 for r in kept), "failed": [r["status"] for r in kept if r["status"] != 200],
        "rss_mib": {"start": round(rss[0][1] / 2**20, 1), "after_warmup": round(warm[0] / 2**20, 1),
                    "end": round(rss[-1][1] / 2**20, 1), "max_after_warmup": round(max(warm) / 2**20, 1)},
        "rss_series": [(round(t, 1), round(b / 2**20, 1)) for t, b in rss],
        "kv_usage_end": after["vllm:kv_cache_usage_perc"], "running_end": after["vllm:num_requests_running"],
        "windows": _windows(kept, 30.0),
    }


def _p99(xs: list[float]) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))], 4) if xs else None


def _windows(records: list[dict], width_s: float) -> list[dict]:
    """p99 TTFT (streamed answers) and p99 ITL (streamed, n = 1) of the requests sent in each window."""
    out = []
    for k in range(int(max((r["t"] for r in records), default=0) // width_s) + 1):
        rs = [r for r in records if k * width_s <= r["t"] < (k + 1) * width_s]
        out.append({"t": k * width_s, "requests": len(rs), "ttft_p99": _p99([r["ttft"] for r in rs if r["ttft"]]),
                    "itl_p99": _p99([g for r in rs for g in r["itl"]])})
    return out


def plot_soak(result: dict, machine: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = [x for x in result["windows"] if x["ttft_p99"] is not None]
    fig, (lat, mem) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    t = [x["t"] / 60 for x in w]
    nan = float("nan")
    lat.plot(t, [x["ttft_p99"] for x in w], "o-", label="TTFT p99 (streamed answers)")
    lat.plot(t, [nan if x["itl_p99"] is None else x["itl_p99"] for x in w], "s-", label="ITL p99 (streamed, n = 1)")
    lat.set_ylabel("seconds (30 s windows)")
    lat.set_yscale("log")
    lat.legend()
    lat.set_title(f"Soak at {result['offered_req_per_s']:.2f} req/s ({result['offered_req_per_s'] / result['saturation_req_per_s']:.0%}"
                  f" of saturation), {result['requests']} requests\n{machine}", fontsize=9)
    mem.plot([x / 60 for x, _ in result["rss_series"]], [m for _, m in result["rss_series"]], "-", color="gray")
    mem.set_ylim(0, 1.15 * max(m for _, m in result["rss_series"]))
    mem.ticklabel_format(axis="y", useOffset=False)
    mem.set_ylabel("server RSS (MiB)")
    mem.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------ the command line
def main() -> None:
    import minillm  # noqa: F401  (the course model must be installed)
    from minillm.course.bench import machine_info, machine_label, provenance
    from minillm.course.launch_server import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["fuzz", "overload", "soak"], choices=["fuzz", "overload", "soak"])
    ap.add_argument("--cases", type=int, default=2500, help="fuzz: requests to send (default 2500)")
    ap.add_argument("--requests", type=int, default=500, help="overload: the burst (default 500)")
    ap.add_argument("--minutes", type=float, default=10.0, help="soak: how long (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = RESULTS / "cpu_server_abuse.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    info = machine_info()
    results["machine"] = info
    results.update(provenance())               # this run's: a part not rerun now was measured before it
    name = "smol"
    if "fuzz" in args.parts:
        with ServerProcess.minillm(["--served-model-name", name, "--max-model-len", "64",
                                    "--max-tokens-default", "16"]) as srv:
            from tqdm import tqdm
            bar = tqdm(total=args.cases, desc="fuzz", unit="case")
            t0 = time.perf_counter()
            results["fuzz"] = fuzz(srv.url, name, args.cases, args.seed, progress=lambda n: bar.update(1))
            results["fuzz"]["seconds"] = round(time.perf_counter() - t0, 1)
            bar.close()
        print(json.dumps({k: v for k, v in results["fuzz"].items() if k != "by_case"}, indent=1))
    if "overload" in args.parts:     # a pool of 0.012 GiB: 17 blocks of 16 tokens, a handful of requests
        with ServerProcess.minillm(["--served-model-name", name, "--max-num-seqs", "16", "--max-queued-requests",
                                    "64", "--kv-cache-memory", "0.012"]) as srv:
            results["overload"] = overload(srv.url, name, _questions()[:8], args.requests, max_tokens=32)
        print(json.dumps(results["overload"], indent=1))
    if "soak" in args.parts:
        with ServerProcess.minillm(["--served-model-name", name]) as srv:
            results["soak"] = soak(srv.url, name, srv.proc.pid, args.minutes, seed=args.seed)
        plot_soak(results["soak"], machine_label(info), RESULTS / "cpu_server_soak.png")
        print(json.dumps({k: v for k, v in results["soak"].items() if k not in ("rss_series", "windows")}, indent=1))
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
