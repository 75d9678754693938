"""n samples of one prompt (fork) and per-token log-probabilities, in the serving engine."""
import pytest
import torch

from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])


def finish(engine, after_first_step=None):
    finals, first = {}, True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if first and after_first_step:
            after_first_step(engine)
        first = False
    return finals


@pytest.mark.parametrize("caching", [False, True])
def test_n_samples_share_the_prompt_and_equal_their_solo_runs(model, tokenizer, prompt, caching):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    engine = LLMEngine(model, tokenizer, enable_prefix_caching=caching, kv_cache_memory=64 << 20, verbose=False)
    ids = engine.add_request("a", prompt, params, n=3)
    assert ids == ["a", "a/1", "a/2"]
    prompt_blocks = engine.pool.blocks_for(len(prompt))
    used = []
    finals = finish(engine, lambda e: used.append(e.stats()["kv_blocks_used"]))
    assert used == [prompt_blocks]                       # computed once, shared by all three
    assert engine.stats()["kv_blocks_used"] == 0         # and all given back
    assert len({tuple(finals[i].token_ids) for i in ids}) == 3
    for i, rid in enumerate(ids):                        # sample i is the solo run with seed + i
        solo = LLMEngine(model, tokenizer, enable_prefix_caching=caching, kv_cache_memory=64 << 20, verbose=False)
        solo.add_request("s", prompt, SamplingParams(temperature=0.8, seed=5 + i, max_tokens=12, ignore_eos=True))
        assert finish(solo)["s"].token_ids == finals[rid].token_ids


def test_aborting_before_the_fork_ends_every_sample(model, tokenizer, prompt):
    engine = LLMEngine(model, tokenizer, max_num_batched_tokens=8, kv_cache_memory=64 << 20, verbose=False)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4), n=2)
    engine.step()                                        # a chunk of the prompt only
    assert engine.abort_request("a")
    finals = finish(engine)
    assert {k: v.finish_reason for k, v in finals.items()} == {"a": "abort", "a/1": "abort"}
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_samples_never_run_more_sequences_than_max_num_seqs(model, tokenizer, policy):
    """A request of n samples takes n of the max_num_seqs slots from its admission (its prompt runs as
    one sequence, then forks): with 4 slots, n = 3 runs beside n = 1 but never beside n = 2."""
    engine = LLMEngine(model, tokenizer, max_num_seqs=4, policy=policy, kv_cache_memory=64 << 20, verbose=False)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, n in (("a", 3), ("c", 1), ("b", 2), ("d", 3)):
        engine.add_request(rid, tokenizer.encode(f"Request {rid} asks"), params, n=n)
    most, finals = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        most = max(most, sum(1 + len(r.forks) for r in engine.scheduler.running))
    assert most == 4 and len(finals) == 9 and all(len(o.token_ids) == 3 for o in finals.values())


def test_n_is_checked(model, tokenizer, prompt):
    engine = LLMEngine(model, tokenizer, max_num_seqs=4, kv_cache_memory=64 << 20, verbose=False)
    for n in (0, 5, 2.0):
        with pytest.raises(ValueError, match="n must be an integer in"):
            engine.add_request("a", prompt, n=n)
    assert not engine.has_unfinished_requests()


def test_logprobs_are_the_models_log_softmax(model, tokenizer, prompt):
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20, verbose=False)
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, logprobs=3))
    out = finish(engine)["a"]
    assert len(out.logprobs) == len(out.token_ids) == 5
    ids = prompt + out.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids]))[0, len(prompt) - 1:-1].float(), dim=-1)   # (5, vocab)
    for t, (tok, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp == pytest.approx(ref[t, tok].item(), abs=1e-4)
        assert [i for i, _ in top] == ref[t].topk(3).indices.tolist()
        assert top[0][0] == tok                          # greedy: the chosen token is the best
    with pytest.raises(ValueError, match="logprobs must be"):
        SamplingParams(logprobs=21)
