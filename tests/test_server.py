"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client and by
raw HTTP: exact greedy answers, streaming, n, seeds, stops, usage, 50 concurrent streams, a client
that leaves mid-answer, and every kind of bad request answered in OpenAI's error shape."""
import asyncio
import json
import re

import httpx
import pytest

from helpers.live_server import live_server
from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams

openai = pytest.importorskip("openai")
MODEL = "smol"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_model_len=512, max_num_seqs=64) as s:
        yield s


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def engine_text(model, tokenizer, ids, max_tokens):
    """The engine's own greedy answer, in this process (the reference the server must give)."""
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20, verbose=False)
    engine.add_request("r", ids, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def metrics(url) -> dict:
    """/metrics as {series: value}, by full name with labels and by name alone (the last of its series)."""
    series = dict(re.findall(r"^(vllm:\S+)\s+(\S+)$", httpx.get(f"{url}/metrics").text, re.M))
    return {k: float(v) for k, v in series.items()} | {re.sub(r"\{.*", "", k): float(v) for k, v in series.items()}


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200


def test_chat_streamed_equals_whole_equals_engine(model, tokenizer, client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = engine_text(model, tokenizer, tokenizer.apply_chat_template(QUESTION), 24)
    assert whole.choices[0].message.content == streamed == ref.text
    assert "Paris" in streamed
    assert chunks[0].choices[0].delta.role == "assistant"
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_each_backend_serves_the_engines_greedy_answers(model, native_model, tokenizer):
    """The same weights served twice, on the torch and the native backend: chat and completions, whole and
    streamed, give the torch engine's greedy text on both."""
    chat_ref = engine_text(model, tokenizer, tokenizer.apply_chat_template(QUESTION), 24)
    text_ref = engine_text(model, tokenizer, tokenizer.encode("1, 2, 3, 4,"), 10)
    with live_server({"torch": model, "native": native_model}, tokenizer, max_model_len=512) as (url, _, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for name in ("torch", "native"):
            whole = c.chat.completions.create(model=name, messages=QUESTION, max_tokens=24, temperature=0)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=name, messages=QUESTION, max_tokens=24, temperature=0, stream=True) if ch.choices)
            assert whole.choices[0].message.content == streamed == chat_ref.text, name
            done = c.completions.create(model=name, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
            assert done.choices[0].text == text_ref.text, name


def test_completion_text_and_token_ids_streamed_with_usage(model, tokenizer, client):
    ids = tokenizer.encode("1, 2, 3, 4,")
    ref = engine_text(model, tokenizer, ids, 10)
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert whole.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_several_prompts_in_one_completion(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert r.choices[1].text == single.choices[0].text


def test_stop_string_cuts_the_answer(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    assert r.choices[0].text == " 5, 6," and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=" 7",
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == " 5, 6,"


def test_seed_reproduces_and_n_gives_distinct_samples(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=16,
              temperature=1.0, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(**kw, n=3)
    texts = [c.message.content for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2] and texts[0] == a.choices[0].message.content
    assert len(set(texts)) == 3
    fixed = client.chat.completions.create(**kw, n=3, extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 3 * 16
    streamed = list(client.chat.completions.create(**kw, n=3, stream=True))
    joined = {i: "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
              for i in range(3)}
    assert [joined[i] for i in range(3)] == texts


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token


def test_fifty_concurrent_streams_get_their_solo_answers(url, client):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(10)]
    solo = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def one(p):
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)
        return p, "".join([c.choices[0].text async for c in stream])

    async def main():
        try:
            return await asyncio.gather(*[one(prompts[i % 10]) for i in range(50)])
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 50
    for p, text in results:
        assert text == solo[p], p


def test_client_that_leaves_aborts_its_request(url, client):
    before = metrics(url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]                # a few tokens, then hang up
    assert any(line.startswith("data:") for line in got)
    for _ in range(200):
        m = metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    aborted = 'vllm:request_success_total{finished_reason="abort",model_name="smol"}'
    assert m.get(aborted, 0) == before.get(aborted, 0) + 1
    assert m["vllm:generation_tokens_total"] < before.get("vllm:generation_tokens_total", 0) + 400
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_metrics_have_vllms_names(url, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:iteration_tokens_total_bucket"):
        assert f"\n{name}{{" in text, name


LONG = "word " * 600
BAD = [   # (path, body: dict or raw bytes, status, param or None, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "required"),
    ("/v1/chat/completions", {"model": MODEL, "prompt": "hi"}, 400, "prompt", "unrecognized"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model", "required"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "512"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "512"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400, "prompt", "token ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages",
     "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages.0.role", "required"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": QUESTION}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n", "[1, 64]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty",
     "[-2, 2]"),
    ("/v1/completions", b'{"model": "smol", "prompt": "' + b"a" * (5 << 20) + b'"}', 413, None, "limit"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_a_clear_error_and_the_server_stays_healthy(url, path, body, status, param, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert httpx.get(f"{url}/health").status_code == 200


def test_unknown_route_is_a_404_in_openai_shape(url):
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_api_key(model, tokenizer):
    with live_server(model, tokenizer, MODEL, api_key="s3cret") as (url, _, _):
        assert httpx.get(f"{url}/health").status_code == 200               # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                r = httpx.request(method, f"{url}{path}", headers=headers, json={})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_answers_503(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_num_seqs=1, max_queued_requests=1) as (url, _, _):
        long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
                    lines = running.aiter_lines()
                    while not (await lines.__anext__()).startswith("data:"):
                        pass                                           # it runs: the one sequence is taken
                    queued = asyncio.create_task(c.post("/v1/completions", json={**long, "max_tokens": 2}))
                    for _ in range(200):
                        if metrics(url).get("vllm:num_requests_waiting") == 1:
                            break
                        await asyncio.sleep(0.05)
                    refused = await c.post("/v1/completions", json=long)
                await asyncio.sleep(0)
                return refused, await queued

        refused, queued = asyncio.run(main())
        assert refused.status_code == 503 and "--max-queued-requests" in refused.json()["error"]["message"]
        assert queued.status_code == 200


def test_load_generator_measures_a_server(url):
    from minillm.course.bench_http import run_http_bench
    from minillm.course.bench_serve import load_workload, summarize_system

    items = load_workload(num_requests=6, length_scale=0.05, request_rate=20.0, seed=1)
    replay = run_http_bench(url, items, max_concurrency=4, progress=False)
    r = summarize_system("minillm", replay)
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["requests_per_s"] == pytest.approx(6 / r["duration_s"])
    assert r["output_tokens"] == sum(w.output_len for w in items)          # ignore_eos: every token came
    assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] and r["itl_s"]["p99"] > 0
    bad = run_http_bench(url, items[:2], model="not-served", progress=False)
    assert summarize_system("x", bad)["failed"] == 2                       # 404s are counted as failures


def test_serve_command_finishes_running_streams_on_shutdown(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from helpers.live_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--threads", "1",
                             "--kv-cache-memory", "0.05", "--served-model-name", MODEL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGINT)                               # Ctrl-C while it streams
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"   # it ran to the end
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    log = proc.stdout.read()
    assert "127.0.0.1" in log and "Traceback" not in log, log


def test_the_engine_steps_on_the_thread_that_built_it(model, tokenizer):
    """`serve` loads each model in its engine thread and steps it there: one team of OpenMP threads."""
    import threading

    from minillm.server.async_engine import AsyncEngine, engine_thread

    thread = engine_thread()
    built_on, engine = thread.submit(lambda: (threading.get_ident(),
                                              LLMEngine(model, tokenizer, kv_cache_memory=16 << 20, verbose=False))).result()
    stepped_on, step = set(), engine.step
    engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
    aengine = AsyncEngine(engine, runs_on=thread)
    aengine.start()

    async def ask():
        return [o async for o in aengine.generate("r", tokenizer.encode("Hi"), SamplingParams(max_tokens=3))]
    try:
        assert aengine.healthy
        outs = asyncio.run(ask())
    finally:
        aengine.stop()
    assert outs[-1].finished and len(outs[-1].token_ids) == 3
    assert stepped_on == {built_on}
    assert not aengine.healthy


def test_text_workload_starts_where_asked_and_wraps(tmp_path):
    """Runs one after another (notebook 11's rates) take different prompts: `start` picks the first line."""
    from minillm.course.bench_http import load_text_workload

    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    assert [w.prompt for w in load_text_workload(path, 3, start=0)] == ["q0", "q1", "q2"]
    assert [w.prompt for w in load_text_workload(path, 3, start=3)] == ["q3", "q4", "q0"]
    assert [w.prompt for w in load_text_workload(path, 7, start=6)] == ["q1", "q2", "q3", "q4", "q0", "q1", "q2"]
