"""Speculative decoding inside the serving engine, on the real model: every request keeps its solo
greedy tokens under staggered arrivals, tiny budgets and preemption; drafts are rolled back, blocks
come back, only accepted tokens enter the prefix cache."""
import pytest

from minillm import LLM
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.sampling import SamplingParams
from minillm.speculative import DraftModelProposer, Proposer
from test_engine import run   # add prompts (staggered or at once, aborts), step to the end: final outputs by index

pytestmark = pytest.mark.slow

TEXTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The red fox jumps over the lazy dog. The red fox jumps over the",
]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def solo(model, tokenizer, prompts):
    """Each prompt alone, plain greedy decoding (kv stage, equal to naive by its own tests)."""
    return [generate(model, tokenizer, p, GREEDY, stage="kv").token_ids for p in prompts]


def check(engine, finals, solo, skip=()):
    for i, ref in enumerate(solo):
        if i not in skip:
            assert finals[i].token_ids == ref, f"request {i}: {finals[i].token_ids} != solo {ref}"
    assert engine.stats()["kv_blocks_used"] == 0 or engine.config.enable_prefix_caching
    assert all(not r.spec_token_ids for r in engine.requests.values())


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("proposer", ["ngram", "layers:20"])
def test_greedy_tokens_unchanged_under_staggered_arrivals(backend_model, tokenizer, prompts, solo, proposer, k):
    engine = LLMEngine(backend_model, tokenizer, kv_cache_memory=32 << 20, adaptive_speculation=False,
                       speculative=proposer,
                       num_speculative_tokens=k, verbose=False)
    n, length = (5, 16) if proposer == "ngram" else (3, 8)      # the layer-skipping draft is slow on a CPU
    finals = run(engine, prompts[:n], SamplingParams(max_tokens=length, ignore_eos=True), arrive_every=2)
    check(engine, finals, [ref[:length] for ref in solo[:n]])
    s = engine.stats()
    assert s["spec_drafts"] > 0 and s["spec_accepted_tokens"] <= s["spec_draft_tokens"] <= k * s["spec_drafts"]
    if proposer == "ngram":
        assert s["spec_accepted_tokens"] > 0      # the counting and the code prompts repeat themselves


def test_tiny_budget_and_preemption(model, tokenizer, prompts, solo):
    # 14 blocks of 4 tokens for five requests of 21-52 tokens: preemption; a budget of 6 tokens: chunking
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=14, max_num_batched_tokens=6,
                       adaptive_speculation=False,
                       speculative="ngram", num_speculative_tokens=4, verbose=False, enable_prefix_caching=False)
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        assert batch.total_tokens <= 6
        seen.append(max(batch.num_spec_slots, default=0))
        return batch

    engine.scheduler.schedule = spy
    finals = run(engine, prompts, arrive_every=1)
    assert engine.stats()["num_preemptions"] > 0 and max(seen) > 0
    check(engine, finals, solo)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


class Oracle(Proposer):
    """Proposes each prompt's known continuation (EOS and junk after it): drafts that hit where a test wants."""

    def __init__(self, continuations: dict):
        self.cont = continuations

    def propose(self, token_ids, k):
        for prompt, cont in self.cont.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return cont[done:done + k], None
        return [], None


def test_eos_in_a_draft_as_the_bonus_and_max_tokens_mid_run(model, tokenizer):
    q = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=40)
    ref = generate(model, tokenizer, q, params, stage="kv")
    assert ref.finish_reason == "stop"
    n = len(ref.token_ids)
    junk = [tokenizer.im_end_id, 11, 12, 13, 14, 15, 16, 17, 18]
    for k, cont in [(8, ref.token_ids + junk),             # EOS accepted inside a draft, tokens after it dropped
                    (n - 1, ref.token_ids)]:               # drafts end before EOS: EOS is the bonus token
        llm = LLM(model, tokenizer, kv_cache_memory=16 << 20, adaptive_speculation=False,
                  speculative=Oracle({tuple(q): cont}),
                  num_speculative_tokens=k, verbose=False)
        [out] = llm.generate([q], params, use_tqdm=False)
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, "stop")
        assert llm.engine.stats()["spec_accepted_tokens"] > 0
    for max_tokens in (1, 2, 6):                             # max_tokens reached inside an accepted run
        llm = LLM(model, tokenizer, kv_cache_memory=16 << 20, adaptive_speculation=False,
                  speculative=Oracle({tuple(q): ref.token_ids}),
                  num_speculative_tokens=5, verbose=False)
        [out] = llm.generate([q], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
        assert out.token_ids == ref.token_ids[:max_tokens] and out.finish_reason == "length"


def test_prefix_cache_holds_only_accepted_tokens(model, tokenizer, prompts, solo):
    from minillm.kv.prefix_cache import chain_hashes

    engine = LLMEngine(model, tokenizer, block_size=4, kv_cache_memory=16 << 20, adaptive_speculation=False,
                       speculative="ngram",
                       num_speculative_tokens=5, verbose=False)
    first = run(engine, prompts[:1])[0]
    assert engine.stats()["spec_draft_tokens"] > engine.stats()["spec_accepted_tokens"] > 0   # some were rejected
    accepted = prompts[0] + first.token_ids
    chain = chain_hashes(accepted, 4)                          # the addresses of the real sequence's blocks
    assert engine.pool.cached, "nothing was cached"
    for address, block in engine.pool.cached.items():          # every cached block holds accepted tokens
        i = chain.index(address)
        assert engine.pool.block_key[block][1] == tuple(accepted[4 * i:4 * i + 4])
    again = run(engine, [accepted[:len(prompts[0]) + 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert again.num_cached_tokens > len(prompts[0])          # the answer's blocks were found
    assert again.token_ids == solo[0][8:16]


def test_abort_and_sampled_requests(model, tokenizer, prompts, solo):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, adaptive_speculation=False, speculative="layers:20",
                       num_speculative_tokens=3, verbose=False, enable_prefix_caching=False)
    finals = run(engine, prompts, abort={2: 3})
    assert finals[2].finish_reason == "abort"
    check(engine, finals, solo, skip=(2,))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    a = run(LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, adaptive_speculation=False,
                      speculative="layers:20", verbose=False),
            prompts[:2], sampled)
    b = run(LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, adaptive_speculation=False,
                      speculative="layers:20", verbose=False),
            prompts[:2], sampled)
    assert [a[i].token_ids for i in (0, 1)] == [b[i].token_ids for i in (0, 1)]
    assert all(len(a[i].token_ids) == 12 for i in (0, 1))


def test_bad_speculative_options(model, tokenizer):
    from test_paged_torch import tiny_model

    for spec, k, msg in [("bogus", 3, "unknown speculative proposer"), ("layers:30", 3, "fewer layers"),
                         ("ngram", 0, "num_speculative_tokens"), ("draft:q5", 3, "unknown quantization"),
                         ("ngram+layers:3", 3, "a cascade is"),
                         (DraftModelProposer(tiny_model()), 3, "vocabulary")]:
        with pytest.raises(ValueError, match=msg):
            LLMEngine(model, tokenizer, kv_cache_memory=8 << 20, adaptive_speculation=False,
                      speculative=spec, num_speculative_tokens=k,
                      verbose=False)


@pytest.mark.parametrize("proposer", ["ngram", "layers:20"])
def test_adaptive_speculation_keeps_every_requests_greedy_tokens(backend_model, tokenizer, prompts, solo, proposer):
    """Each request drafts 0..k tokens a step as its controller chooses from its acceptance and the step costs
    the engine fits; a tiny pool and budget make requests preempt and chunk meanwhile. The tokens are the
    solo greedy ones, and every request ends with no draft left."""
    engine = LLMEngine(backend_model, tokenizer, block_size=4, num_blocks=24, max_num_batched_tokens=12,
                       speculative=proposer, num_speculative_tokens=4, adaptive_speculation=True, verbose=False)
    n = 5 if proposer == "ngram" else 3
    finals = run(engine, prompts[:n], GREEDY, arrive_every=2)
    check(engine, finals, solo[:n])
    assert all(r.spec_control is None or 0 <= r.spec_control.alpha <= 1 for r in engine.requests.values())
    with pytest.raises(ValueError, match="speculative"):
        LLMEngine(backend_model, tokenizer, num_blocks=8, adaptive_speculation=True, verbose=False)


def test_a_proposer_alone_drafts_adaptively(backend_model, tokenizer):
    """speculative= alone chooses 0..k drafts a step (a fixed k measured up to 2x slower than plain decoding
    on a CPU where a pass over k + 1 tokens leaves the C loop: benchmarks/speculative.py); k every step only
    when asked for."""
    def make(**options):
        return LLMEngine(backend_model, tokenizer, num_blocks=8, verbose=False, **options)
    assert make(speculative="ngram").speculator.times is not None
    assert make(speculative="ngram", adaptive_speculation=False).speculator.times is None
    assert make().speculator is None and make(adaptive_speculation=False).speculator is None


def draft_blocks_used(engine) -> int:
    kv = engine.speculator.draft.kv
    return kv.pool.num_blocks - kv.num_free_blocks


def test_quantized_draft_model_under_preemption_and_abort(model, tokenizer, prompts, solo):
    """The model's 4-bit copy drafts from a block pool of its own: staggered arrivals, a pool small enough to
    preempt, chunked prompts and an abort; every other request keeps its solo greedy tokens, and both pools
    are whole at the end (preemption and abort free the draft's blocks with the target's)."""
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=14, max_num_batched_tokens=6,
                       adaptive_speculation=False,
                       speculative="draft:q4", num_speculative_tokens=3, verbose=False, enable_prefix_caching=False)
    finals = run(engine, prompts, arrive_every=1, abort={2: 6})
    assert finals[2].finish_reason == "abort"
    check(engine, finals, solo, skip=(2,))
    s = engine.stats()
    assert s["num_preemptions"] > 0
    assert s["spec_draft_tokens"] >= s["spec_accepted_tokens"] > s["spec_draft_tokens"] // 2   # a close draft
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert draft_blocks_used(engine) == s["draft_kv_blocks_used"] == 0 and not engine.speculator.draft.seqs


def test_draft_pool_prefix_cache_and_cascade(model, tokenizer, prompts, solo):
    """With prefix caching the draft pool keeps blocks of accepted tokens: the same prompt again finds them
    in both pools. 'ngram+draft:q4' looks up first and drafts with the model where the lookup finds nothing."""
    engine = LLMEngine(model, tokenizer, block_size=4, kv_cache_memory=16 << 20, adaptive_speculation=False,
                       speculative="ngram+draft:q4",
                       num_speculative_tokens=4, verbose=False)
    finals = run(engine, prompts[:3], arrive_every=1)
    check(engine, finals, solo[:3])
    draft = engine.speculator.draft
    assert draft.kv.prefix_cache_hits == 0 and not draft.seqs
    again = run(engine, [prompts[2]])[0]
    assert again.token_ids == solo[2] and draft.kv.prefix_cache_hits > 0
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_sampled_draft_model_requests_are_seeded(model, tokenizer, prompts):
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    a, b = (run(LLMEngine(model, tokenizer, kv_cache_memory=16 << 20, adaptive_speculation=False,
                          speculative="draft:q4", verbose=False),
                prompts[:2], sampled) for _ in range(2))
    assert [a[i].token_ids for i in (0, 1)] == [b[i].token_ids for i in (0, 1)]
    assert all(len(a[i].token_ids) == 12 for i in (0, 1))
