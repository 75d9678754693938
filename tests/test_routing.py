"""Model routing: the confidence signals, the trade-off sweep, the offline cascade, and a server holding two
configurations of the course model (its 4-bit copy and itself) with "auto" routed between them, driven by
the openai client."""
import math

import httpx
import pytest

from helpers.live_server import live_server
from minillm.course.routing_costs import auc, tradeoff
from minillm.routing import RoutePolicy, Router, confidence
from minillm.sampling import SamplingParams
from minillm.speculative import quantized_copy

openai = pytest.importorskip("openai")


def test_confidence_signals():
    sure = [(-0.01, [(1, -0.01), (2, -5.0)])] * 10
    unsure_once = sure[:5] + [(-3.0, [(3, -1.0), (4, -1.1)])] * 2 + sure[:3]
    for signal in ("mean", "min", "entropy"):
        assert confidence(sure, signal) > confidence(unsure_once, signal)
    assert confidence(unsure_once, "min", window=2) == pytest.approx(-3.0)          # the worst stretch
    assert confidence(unsure_once, "mean") == pytest.approx((8 * -0.01 + 2 * -3.0) / 10)
    assert confidence([], "entropy") == 0.0
    with pytest.raises(ValueError, match="unknown confidence signal"):
        confidence(sure, "vibes")


def test_auc_and_tradeoff_ends():
    assert auc([3, 2, 1, 0], [True, True, False, False]) == 1.0
    assert auc([0, 1], [True, False]) == 0.0 and math.isnan(auc([1], [True]))
    rows = [{"mean": c, "agrees": a, "cheap_s": 1.0, "exact_s": 4.0}
            for c, a in [(-0.1, True), (-0.2, True), (-0.9, False), (-1.5, False)]]
    points = tradeoff(rows, "mean")
    never, always = points[0], points[-1]
    assert (never["escalated"], never["relative_cost"], never["agreement"]) == (0.0, 0.25, 0.5)
    assert (always["escalated"], always["relative_cost"], always["agreement"]) == (1.0, 1.25, 1.0)
    at = next(p for p in points if p["threshold"] == -0.2)              # the two unsure ones escalate
    assert (at["escalated"], at["agreement"]) == (0.5, 1.0)


def test_route_policy_checks():
    for kwargs, msg in [({"cheap": "a", "exact": "a", "threshold": 0.0}, "two different"),
                        ({"cheap": "a", "exact": "b", "threshold": math.inf}, "finite"),
                        ({"cheap": "a", "exact": "b", "threshold": 0.0, "signal": "x"}, "unknown confidence")]:
        with pytest.raises(ValueError, match=msg):
            RoutePolicy(**kwargs)


@pytest.fixture(scope="module")
def fast(model):
    return quantized_copy(model, "q4")


def test_offline_router_escalates_below_the_threshold(model, tokenizer, fast):
    from minillm import LLM

    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Zebra quantum pickle")]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cheap, exact = (LLM(m, tokenizer, kv_cache_memory=16 << 20, verbose=False) for m in (fast, model))
    solo = {name: [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            for name, llm in (("cheap", cheap), ("exact", exact))}
    seen = [r.confidence for r in Router(cheap, exact, -math.inf).route(prompts, params)]
    middle = sorted(seen)[1]                                  # escalates exactly the least confident one
    routed = Router(cheap, exact, middle).route(prompts, params)
    for i, r in enumerate(routed):
        want = "exact" if seen[i] < middle else "cheap"
        assert r.model == want and r.output.token_ids == solo[want][i]
        assert r.confidence == pytest.approx(seen[i])
    assert [r.model for r in routed].count("exact") == 1


def test_server_routes_auto_between_two_configurations(model, tokenizer, fast):
    """fast = the 4-bit copy, exact = the float32 model. A threshold no answer reaches escalates every
    request to exact; one every answer passes keeps fast's. The response names the model that answered,
    the router's log-probabilities never leak into it, and streams are whole. (No prefix cache: a 4-bit
    model's near-ties can fall the other way when a prompt's start comes from the cache.)"""
    from minillm import LLM

    msgs = [{"role": "user", "content": "Name a primary colour."}]
    params = SamplingParams(max_tokens=8)
    solo = {name: LLM(m, tokenizer, kv_cache_memory=8 << 20, verbose=False).chat(msgs, params, use_tqdm=False)[0].text
            for name, m in (("fast", fast), ("exact", model))}          # each model's own engine, alone
    for threshold, answers in [(1.0, "exact"), (-1e9, "fast")]:
        route = RoutePolicy("fast", "exact", threshold)
        with live_server({"fast": fast, "exact": model}, tokenizer, route=route,
                         enable_prefix_caching=False) as (url, _, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["fast", "exact", "auto"]
            r = client.chat.completions.create(model="auto", messages=msgs, max_tokens=8, temperature=0)
            assert (r.model, r.choices[0].message.content) == (answers, solo[answers])
            assert r.choices[0].logprobs is None
            pieces = [c for c in client.chat.completions.create(model="auto", messages=msgs, max_tokens=8,
                                                                  temperature=0, stream=True)]
            assert {c.model for c in pieces} == {answers}
            assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == solo[answers]
            c = client.completions.create(model="auto", prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
            assert c.model == answers and c.choices[0].logprobs is None
            direct = client.chat.completions.create(model="fast", messages=msgs, max_tokens=8, temperature=0)
            assert direct.model == "fast" and direct.choices[0].message.content == solo["fast"]
            with pytest.raises(openai.NotFoundError, match="'fast', 'exact', 'auto'"):
                client.chat.completions.create(model="slow", messages=msgs, max_tokens=2)
            metrics = httpx.get(f"{url}/metrics").text
            assert f'minillm:routed_requests_total{{model_name="auto",routed_to="{answers}"}} 3.0' in metrics
            assert 'vllm:generation_tokens_total{model_name="exact"}' in metrics


def test_bad_routing_setups(model, tokenizer):
    from minillm.engine import LLMEngine
    from minillm.server import create_app

    engine = LLMEngine(model, tokenizer, kv_cache_memory=8 << 20, verbose=False)
    with pytest.raises(ValueError, match="both must be served"):
        create_app({"a": engine}, route=RoutePolicy("a", "b", 0.0))
    with pytest.raises(ValueError, match="needs a name"):
        create_app(engine)


def test_serve_model_flags():
    from minillm.cli.serve import parse_models

    assert parse_models(None, None) == [(None, None, None)]
    assert parse_models(["m.gguf"], "smol") == [("smol", "m.gguf", None)]
    assert parse_models(["fast=:quant=q4", r"exact=C:\models\m.gguf"], None) == \
        [("fast", None, "q4"), ("exact", r"C:\models\m.gguf", None)]
    for values, name in [(["a=x", "a=y"], None), (["auto=x", "b=y"], None), (["a=x", "b=y"], "smol"), (["x", "b=y"], None)]:
        with pytest.raises(SystemExit):
            parse_models(values, name)
