"""Scoring a prompt in the engine (what lm-eval's loglikelihood asks of a server): each prompt token's
log-probability equals log_softmax of the model's own float32 logits, whether the prompt is computed
in one step or in chunks, with its prefix in the cache or after a preemption; max_tokens=0 scores
only. And the penalties: greedy follows the penalized logits, in the engine as in the single stream."""
import pytest
import torch

from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.sampling import SamplingParams, penalize

TEXT = "The quick brown fox jumps over the lazy dog. " * 3


def reference(model, ids):
    """(len(ids), vocab) log-probabilities of the next token after each prefix: the whole prompt in one pass."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
        steps += 1
        assert steps < 500
    return finals


def assert_scored(out, ids, ref, k):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    got = torch.tensor([lp for lp, _ in lps[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    for p, (lp, top) in enumerate(lps[1:]):
        assert len(top) == k
        assert [i for i, _ in top] == ref[p].topk(k).indices.tolist() or k == 0


@pytest.mark.parametrize("budget", [512, 7])             # the prompt in one step, or in chunks of 7 tokens
def test_prompt_logprobs_equal_log_softmax_of_the_model(model, tokenizer, budget):
    ids = tokenizer.encode(TEXT)
    ref = reference(model, ids)
    engine = LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, max_num_batched_tokens=budget, verbose=False)
    out = run(engine, [ids], SamplingParams(max_tokens=3, prompt_logprobs=2))[0]
    assert_scored(out, ids, ref, 2)
    assert out.token_ids == ref[-1:].argmax(-1).tolist() + out.token_ids[1:]     # and it still generates


def test_scoring_computes_a_cached_prefix_again_and_max_tokens_zero_generates_nothing(model, tokenizer):
    ids = tokenizer.encode(TEXT)
    ref = reference(model, ids)
    engine = LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, verbose=False)
    run(engine, [ids], SamplingParams(max_tokens=2))                  # now its blocks are in the prefix cache
    out = run(engine, [ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0                                  # a cached block has no logits
    assert_scored(out, ids, ref, 0)
    assert out.token_ids == [] and out.finish_reason == "length"
    again = run(engine, [ids], SamplingParams(max_tokens=2))[0]        # plain requests still hit the cache
    assert again.num_cached_tokens > 0
    with pytest.raises(ValueError, match="n must be 1"):
        engine.add_request("x", ids, SamplingParams(max_tokens=0, prompt_logprobs=0), n=2)


def test_scoring_survives_preemption(model, tokenizer):
    """A pool too small for all at once: requests are preempted and recomputed; each is scored once."""
    texts = [TEXT, "Once upon a time, in a land far away, there lived a king who", "1, 2, 3, 4, 5, 6, 7, 8,"]
    prompts = [tokenizer.encode(t) for t in texts]
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=30, max_num_batched_tokens=16, verbose=False)
    finals = run(engine, prompts, SamplingParams(max_tokens=24, prompt_logprobs=1, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert_scored(finals[i], ids, reference(model, ids), 1)


def test_penalties_steer_greedy_in_the_engine_as_in_the_single_stream(model, tokenizer):
    ids = tokenizer.encode("1, 2, 3, 4, 5,")
    plain = generate(model, tokenizer, ids, SamplingParams(max_tokens=8, ignore_eos=True), stage="kv")
    params = SamplingParams(max_tokens=8, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3,
                            logit_bias={plain.token_ids[0]: -100})
    alone = generate(model, tokenizer, ids, params, stage="kv")
    assert alone.token_ids[0] != plain.token_ids[0]                    # the banned token is not chosen
    engine = LLMEngine(model, tokenizer, kv_cache_memory=32 << 20, verbose=False, adaptive_speculation=False,
                       speculative="ngram")
    out = run(engine, [ids], params)[0]                                # (a penalized request is not speculated)
    assert out.token_ids == alone.token_ids
    # the hand computation of the first token: the penalized logits' argmax
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0, -1].float()           # (raw logits: the penalty divides positives)
    first = penalize(logits, params, ids, [])
    assert alone.token_ids[0] == int(first.argmax())
