"""Run prompts through an engine with a tiny pool and token budget (so it chunks and preempts) and compare
each request's tokens with the same model's single-stream kv-stage tokens."""
from minillm.engine import LLMEngine
from minillm.generate import generate


def assert_engine_matches_solo(model, tokenizer, texts, params):
    prompts = [tokenizer.encode(t) for t in texts]
    solo = [generate(model, tokenizer, p, params, stage="kv").token_ids for p in prompts]
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=12, max_num_batched_tokens=8)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.stats()["num_preemptions"] > 0, "the pool was big enough: nothing was preempted"
    assert [finals[i].token_ids for i in range(len(prompts))] == solo
    return engine
