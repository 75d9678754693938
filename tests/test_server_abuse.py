"""The server when clients misbehave: they hang up mid-answer (streamed or not, n > 1), time out and
retry, arrive in a burst past --max-queued-requests, omit max_tokens; and when the model's step raises.
Each ends its own request(s) alone: the blocks come back, the others' answers go on, /health tells the truth."""
import asyncio
import re
import time

import httpx
import pytest

from helpers.live_server import live_server

openai = pytest.importorskip("openai")
MODEL = "smol"
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True}


def metrics(url) -> dict:
    """/metrics as {series: value}, by name alone (the last of its series) and with labels."""
    series = dict(re.findall(r"^(vllm:\S+)\s+(\S+)$", httpx.get(f"{url}/metrics").text, re.M))
    return {k: float(v) for k, v in series.items()} | {re.sub(r"\{.*", "", k): float(v) for k, v in series.items()}


def settled(url, engine, within_s: float) -> float:
    """Seconds until the engine runs nothing and holds no blocks (read from /metrics); fails after within_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        m = metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 \
                and m["vllm:kv_cache_usage_perc"] == 0 and not engine.has_unfinished_requests():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"still running {within_s} s after the client left: {metrics(url)}")


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_model_len=1024) as s:
        yield s


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "n": 1}),
    ("/v1/completions", {"prompt": "Once upon a time", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "n": 2}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_ends_its_request_within_a_step(server, route, body, stream):
    url, _, engine = server
    aborted = 'vllm:request_success_total{finished_reason="abort",model_name="smol"}'
    before = metrics(url).get(aborted, 0)
    with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as c:
        if stream:                                           # a few chunks, then the client hangs up
            with c.stream("POST", url + route, json={**LONG, **body, "stream": True}) as r:
                lines = r.iter_lines()
                assert any(next(lines).startswith("data:") for _ in range(6))
        else:                                                # no answer within 1 s: the client gives up
            with pytest.raises(httpx.ReadTimeout):
                c.post(url + route, json={**LONG, **body})
    waited = settled(url, engine, within_s=5)
    m = metrics(url)
    assert m.get(aborted, 0) == before + body["n"]          # every sample of it aborted, none finished
    assert waited < 2, waited                               # (a step here is well under a second)


def test_a_client_that_times_out_and_retries_leaves_nothing_running(server):
    url, _, engine = server
    impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1.0, max_retries=2)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                     extra_body={"ignore_eos": True})
    settled(url, engine, within_s=5)


def test_a_burst_of_streams_stays_within_the_queue_limit(model, tokenizer):
    """Streamed requests count against --max-queued-requests from the moment they are accepted, before
    their stream starts: of 8 sent at once to 1 sequence slot and a queue of 2, most are refused."""
    with live_server(model, tokenizer, MODEL, max_num_seqs=1, max_queued_requests=2) as (url, _, engine):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}

        async def one(c):
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
                return r.status_code, lines

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await asyncio.gather(*[one(c) for _ in range(8)])

        results = asyncio.run(main())
        served = [lines for status, lines in results if status == 200]
        refused = [status for status, _ in results if status != 200]
        assert set(refused) == {503} and len(served) <= 3, [s for s, _ in results]
        assert all(lines[-1] == "data: [DONE]" for lines in served)
        settled(url, engine, within_s=5)


def test_a_request_without_max_tokens_stops_at_the_servers_default(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_tokens_default=5) as (url, _, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                      "ignore_eos": True}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
        asked = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                          "ignore_eos": True, "max_tokens": 8}, timeout=60).json()
        assert asked["usage"]["completion_tokens"] == 8                   # asked for more: it gets them


def test_a_fault_in_the_model_step_fails_its_batch_and_the_server_goes_on(model, tokenizer):
    with live_server(model, tokenizer, MODEL) as (url, _, engine):
        poison = tokenizer.encode("POISON")
        execute = engine.runner.execute

        def faulty(batch):                                  # a test hook: the step raises for one prompt
            if any(r.prompt_token_ids[:len(poison)] == poison for r in batch.requests):
                raise RuntimeError("injected fault")
            return execute(batch)
        engine.runner.execute = faulty
        good = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        solo = httpx.post(f"{url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]
        bad = httpx.post(f"{url}/v1/completions", json={**good, "prompt": "POISON and more"}, timeout=60)
        assert bad.status_code == 500 and "the model step failed: RuntimeError: injected fault" in \
            bad.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**good, "prompt": "POISON", "stream": True},
                          timeout=60) as r:
            streamed = [line for line in r.iter_lines() if line]
        assert "injected fault" in streamed[0] and streamed[-1] == "data: [DONE]"
        assert httpx.get(f"{url}/health").status_code == 200
        after = httpx.post(f"{url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]
        assert after == solo                                       # the next request is served, exactly
        errors = 'vllm:request_success_total{finished_reason="error",model_name="smol"}'
        assert metrics(url)[errors] == 2 and metrics(url)["vllm:kv_cache_usage_perc"] == 0


def test_when_the_engine_thread_dies_health_and_requests_fail_fast(model, tokenizer):
    with live_server(model, tokenizer, MODEL) as (url, app, engine):
        def broken():                                       # a bug outside the model's step: the thread ends
            raise RuntimeError("the scheduler broke")
        engine.step = broken
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code in (500, 503)
        for _ in range(100):
            if httpx.get(f"{url}/health").status_code == 503:
                break
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "not running" in health.json()["error"]["message"]
        t0 = time.monotonic()
        again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert again.status_code == 503 and time.monotonic() - t0 < 1
