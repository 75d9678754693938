"""Stage 5, the serving engine, on the real model: every request gets its own solo naive-stage
greedy tokens, whatever the arrivals, the token budget, the pool size or the aborts around it."""
import pytest
import torch

from minillm import LLM
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.sampling import SamplingParams

TEXTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at",
    "The three primary colors are red, blue and yellow. Mixing red and blue gives",
]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def naive_tokens(model, tokenizer, prompts):
    """Each prompt alone through stage 1 (no cache, the full score matrix): the reference."""
    return [generate(model, tokenizer, p, GREEDY, stage="naive").token_ids for p in prompts]


def run(engine, prompts, params=GREEDY, arrive_every=0, abort=None, on_step=None):
    """Add the prompts (one every `arrive_every` steps; 0: all at once), step to the end.
    abort: {request index: step at which to abort it}. Returns the final outputs by index."""
    finals, step, added = {}, 0, 0
    while added < len(prompts) or engine.has_unfinished_requests():
        while added < len(prompts) and (arrive_every == 0 or step >= added * arrive_every):
            engine.add_request(added, prompts[added], params)
            added += 1
        for i, at in (abort or {}).items():
            if at == step:
                assert engine.abort_request(i)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if on_step:
            on_step(engine)
        step += 1
        assert step < 2000, "the engine does not finish"
    return finals


def assert_same(finals, naive_tokens, skip=()):
    for i, ref in enumerate(naive_tokens):
        if i not in skip:
            assert finals[i].token_ids == ref, f"request {i}: {finals[i].token_ids} != naive {ref}"
            assert finals[i].finish_reason == "length"


def test_all_at_once_equals_naive(backend_model, tokenizer, prompts, naive_tokens):
    engine = LLMEngine(backend_model, tokenizer, kv_cache_memory=64 << 20)
    assert_same(run(engine, prompts), naive_tokens)
    assert engine.stats()["kv_blocks_used"] == 0


def test_staggered_arrivals_equal_naive(model, tokenizer, prompts, naive_tokens):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    assert_same(run(engine, prompts, arrive_every=3), naive_tokens)


@pytest.mark.parametrize("budget", [8, 13])
def test_tiny_budget_chunks_prompts_among_decodes(backend_model, tokenizer, prompts, naive_tokens, budget):
    engine = LLMEngine(backend_model, tokenizer, max_num_batched_tokens=budget, kv_cache_memory=64 << 20)
    mixed, chunked = [], []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        assert batch.total_tokens <= budget
        mixed.append(1 in batch.num_new_tokens and any(n > 1 for n in batch.num_new_tokens))
        chunked.extend(r.num_computed_tokens + n < len(r.prompt_token_ids)
                       for r, n in zip(batch.requests, batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = spy
    assert_same(run(engine, prompts, arrive_every=2), naive_tokens)
    assert any(chunked), "no prompt was split across steps"
    assert any(mixed), "no step mixed a prefill chunk with decodes"


def test_preemption_recomputes_without_changing_outputs(backend_model, tokenizer, prompts, naive_tokens):
    # 10 blocks of 4 tokens: the six requests need about 6 x 30 tokens, so the pool runs out
    engine = LLMEngine(backend_model, tokenizer, block_size=4, num_blocks=10, max_num_batched_tokens=64)
    finals = run(engine, prompts)
    assert engine.stats()["num_preemptions"] > 0, "the pool was big enough: nothing was preempted"
    assert any(o.num_preemptions for o in finals.values())
    assert_same(finals, naive_tokens)
    assert engine.stats()["kv_blocks_used"] == 0


def test_static_policy_equals_naive(model, tokenizer, prompts, naive_tokens):
    engine = LLMEngine(model, tokenizer, policy="static", max_num_seqs=4, kv_cache_memory=64 << 20)
    sizes = []
    assert_same(run(engine, prompts, on_step=lambda e: sizes.append(e.stats()["running"])), naive_tokens)
    assert max(sizes) == 4


def test_abort_returns_blocks_and_leaves_the_others_unchanged(model, tokenizer, prompts, naive_tokens):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    used = []
    finals = run(engine, prompts, abort={1: 4, 4: 6}, on_step=lambda e: used.append(e.stats()["kv_blocks_used"]))
    assert finals[1].finish_reason == finals[4].finish_reason == "abort"
    assert len(finals[1].token_ids) < MAX_TOKENS
    assert_same(finals, naive_tokens, skip=(1, 4))
    assert used[-1] == 0


def test_abort_frees_blocks_at_once(model, tokenizer, prompts):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    engine.add_request("a", prompts[2], GREEDY)
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort_request("a") and not engine.abort_request("a") and not engine.abort_request("nope")
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.has_unfinished_requests()              # until the next step reports the abort
    [out] = engine.step()
    assert out.request_id == "a" and out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch(model, tokenizer, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = run(LLMEngine(model, tokenizer, kv_cache_memory=64 << 20), [prompts[2]], params)[0].token_ids
    engine = LLMEngine(model, tokenizer, max_num_batched_tokens=16, kv_cache_memory=64 << 20)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)   # unseeded
    for i in (0, 1, 3):
        engine.add_request(f"other{i}", prompts[i], others)
    engine.step()
    busy = run(engine, [prompts[2]], params)[0].token_ids
    assert busy == alone
    single = generate(model, tokenizer, prompts[2], params, stage="kv").token_ids
    assert alone == single, "the engine draws a different sample than the one-prompt loop"


def test_outputs_stream_and_report_metrics(model, tokenizer, prompts):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    engine.add_request("x", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4, 5, 6]
    assert all(a.text == b.text[:len(a.text)] for a, b in zip(seen, seen[1:])), "text only ever grows"
    m = seen[-1].metrics
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s and len(m.itl_s) == 5
    assert m.tpot_s == pytest.approx((m.e2e_s - m.ttft_s) / 5)
    assert seen[-1].text == tokenizer.decode(seen[-1].token_ids)


def test_stop_string_and_stop_token(model, tokenizer):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    ids = tokenizer.encode("1, 2, 3, 4, 5, 6, 7,")
    free = run(engine, [ids], SamplingParams(max_tokens=12))[0]
    assert " 9," in free.text
    engine.add_request("s", ids, SamplingParams(max_tokens=12, stop=[" 9,"]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step()]
    assert texts[-1] == free.text[:free.text.index(" 9,")]
    assert not any(" 9" in t for t in texts), "text held back while it could start a stop string"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = run(engine, [chat], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 64


@pytest.mark.parametrize("prompt, params, message", [
    ([], None, "prompt is empty"),
    ("hello", None, "not text"),
    ([1, 2, 10**6], None, "token ids must be in"),
    ([1] * 9000, None, "shorten it to at most 8191"),
    ([1] * 700, None, "whole KV cache holds 640"),
    ([1, 2], {"max_tokens": 3}, "params must be a SamplingParams"),
])
def test_bad_input_fails_that_request_alone(model, tokenizer, prompts, naive_tokens, prompt, params, message):
    engine = LLMEngine(model, tokenizer, num_blocks=40)
    engine.add_request("ok", prompts[0], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", prompts[1], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["ok"] and finals["ok"].token_ids == naive_tokens[0]


def test_engine_options_are_checked(model, tokenizer):
    with pytest.raises(ValueError, match="policy must be one of"):
        LLMEngine(model, tokenizer, policy="eager", num_blocks=4)
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        LLMEngine(model, tokenizer, enable_chunked_prefill=False, max_num_batched_tokens=512, num_blocks=4)
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(model, tokenizer, kv_cache_memory=100)


def test_no_chunking_prefills_each_prompt_whole(model, tokenizer, prompts, naive_tokens):
    engine = LLMEngine(model, tokenizer, enable_chunked_prefill=False, max_num_batched_tokens=64,
                       max_model_len=64, kv_cache_memory=64 << 20)
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        assert all(r.num_computed_tokens == 0 or n == 1 for r, n in zip(batch.requests, batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = spy
    assert_same(run(engine, prompts, arrive_every=1), naive_tokens)


def test_llm_facade_generate_and_chat(model, tokenizer, naive_tokens):
    llm = LLM(model, tokenizer, kv_cache_memory=64 << 20)
    outs = llm.generate(TEXTS[:3] + [[], "x" * 10], [GREEDY] * 5)
    assert [o.token_ids for o in outs[:3]] == naive_tokens[:3]
    assert outs[3].finish_reason == "error" and "empty" in outs[3].error
    assert outs[4].finish_reason == "length"
    [one] = llm.generate(TEXTS[0], GREEDY)
    assert one.token_ids == naive_tokens[0]
    [ans, bad] = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                           [{"role": "robot", "content": "?"}]], SamplingParams(max_tokens=16))
    assert "Paris" in ans.text and ans.finish_reason == "stop"
    assert bad.finish_reason == "error" and "role" in bad.error
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(TEXTS[:2], [GREEDY] * 3)


def test_packed_forward_logits_equal_one_prompt_at_a_time(model, tokenizer, prompts):
    """The runner's single forward pass over several requests gives each its own logits."""
    from minillm.stages import NaiveRunner

    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(i, p, GREEDY)
    batch = engine.scheduler.schedule()
    logits = engine.runner.execute(batch)                       # (4, vocab)
    for i, p in enumerate(prompts[:4]):
        torch.testing.assert_close(logits[i], NaiveRunner(model).prefill(p), rtol=1e-4, atol=1e-4)
