"""Run prompts through an engine with a tiny pool and token budget (so it chunks and preempts) and compare
each request's tokens with the same model's single-stream kv-stage tokens."""
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.stages import KVCacheRunner


def assert_engine_matches_solo(model, tokenizer, texts, params, near_tie: float = 0.0, kv_cache_dtype=None):
    """near_tie = 0: every request's tokens equal its single-stream tokens exactly.

    near_tie > 0, for models that round activations to bfloat16 (weight-only quantized layers): there a
    chunked or batched pass differs from the single-stream one in the last float32 bits, a bfloat16
    rounding can flip, and where two tokens' logits are that close either is the model's answer. Each
    token the engine emits is then checked against the single-stream model fed the engine's own tokens so
    far: it must be that model's top token, or within near_tie of its logit."""
    prompts = [tokenizer.encode(t) for t in texts]
    solo = [generate(model, tokenizer, p, params, stage="kv", kv_cache_dtype=kv_cache_dtype).token_ids for p in prompts]
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=12, max_num_batched_tokens=8,
                       kv_cache_dtype=kv_cache_dtype)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.stats()["num_preemptions"] > 0, "the pool was big enough: nothing was preempted"
    got = [finals[i].token_ids for i in range(len(prompts))]
    if near_tie == 0 or got == solo:
        assert got == solo
        return engine
    for i, (p, tokens) in enumerate(zip(prompts, got)):
        assert len(tokens) == len(solo[i]), f"request {i}: {len(tokens)} tokens, single-stream {len(solo[i])}"
        runner = KVCacheRunner(model, kv_cache_dtype=kv_cache_dtype)
        logits = runner.prefill(p)
        for j, t in enumerate(tokens):
            top = int(logits.argmax())
            gap = float(logits[top] - logits[t])
            assert gap <= near_tie, (f"request {i}, token {j}: the engine chose {t}, {gap:.3f} below the "
                                     f"single-stream model's top token {top} (a near-tie is {near_tie})")
            logits = runner.decode(t)
    return engine
