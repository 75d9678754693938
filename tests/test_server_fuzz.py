"""The server fuzzed from its own OpenAPI schema, offered far more than it can serve, and sent prompts too long
to run: benchmarks/server_abuse.py's drivers, small and seeded, against a server in this process. The model
behind it is a tiny random one with the course tokenizer's vocabulary (any text is a valid prompt, a step
takes a millisecond): what is tested is the HTTP layer, the scheduler and the pool, not the model."""
import httpx
import pytest

from helpers.benchmark_script import load_benchmark
from helpers.live_server import live_server
from test_paged_torch import tiny_model

pytest.importorskip("schemathesis")
MODEL = "smol"


@pytest.fixture(scope="module")
def abuse():
    return load_benchmark("server_abuse")


@pytest.fixture(scope="module")
def small():
    return tiny_model(vocab_size=49152)


def test_openapi_describes_every_body(small, tokenizer):
    with live_server(small, tokenizer, MODEL) as (url, _, _):
        doc = httpx.get(f"{url}/openapi.json").json()
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]
    temperature = doc["components"]["schemas"]["CompletionRequest"]["properties"]["temperature"]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)


def test_fuzzing_finds_no_5xx_and_no_hang(abuse, small, tokenizer):
    """A few hundred schemathesis cases (valid and invalid bodies for every route), the hand-made bad bodies
    (not JSON, 100,000-deep nesting, huge numbers, lone surrogates, 2 MiB) and random bytes: every answer is
    a 2xx that parses or a 4xx in OpenAI's error shape, and /health stays 200."""
    with live_server(small, tokenizer, MODEL, max_model_len=64, max_tokens_default=16) as (url, _, engine):
        report = abuse.fuzz(url, MODEL, cases=400, seed=0, timeout_s=30)
        abuse.settle(url, within_s=10)
    assert report["failures"] == [] and report["server_errors"] == 0, report
    assert report["cases"] >= 400 and report["statuses"].get("200", 0) >= 20, report


def test_a_burst_ten_times_past_capacity_loses_nothing(abuse, small, tokenizer):
    """200 requests at once against 16 sequence slots, a queue of 64 and a pool of 8 blocks (a handful of
    requests): each is served its solo greedy answer or refused with a 503; the pool ends whole."""
    prompts = [f"Request {i}: tell me about the number {i * 37} and why it matters to people" for i in range(8)]
    with live_server(small, tokenizer, MODEL, max_num_seqs=16, max_queued_requests=64, num_blocks=8) as (url, _, _):
        r = abuse.overload(url, MODEL, prompts, requests=200, max_tokens=40, timeout_s=120)
    assert r["served"] + r["refused_503"] == 200 and r["other"] == [], r
    assert r["served"] >= 64 and r["refused_503"] > 0 and r["refusals_not_queue_full"] == 0, r
    assert r["not_the_solo_answer"] == 0 and r["duplicate_ids"] == 0, r
    assert r["preemptions"] > 0 and r["kv_usage_after"] == 0 and r["waiting_after"] == 0, r


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(small, tokenizer, monkeypatch):
    """A text longer than the context's tokens could cover (each token covers at most max_token_bytes bytes),
    or more sequences than the server runs: refused without a call to the tokenizer."""
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    with live_server(small, tokenizer, MODEL, max_model_len=64, max_num_seqs=4) as (url, _, _):
        long = "a" * (63 * tokenizer.max_token_bytes + 1)
        for route, body in [("/v1/completions", {"prompt": long}),
                            ("/v1/completions", {"prompt": ["Hi", long]}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})]:
            r = httpx.post(url + route, json={"model": MODEL, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 3, "n": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert calls == []
        digits = " ".join(map(str, range(100)))     # short as text, but a token per digit: found by tokenizing
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": digits, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" and calls == [1]
