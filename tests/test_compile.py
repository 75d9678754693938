"""Regional compilation (`minillm/compile.py`): the compiled halves of a block compute what eager does."""
import torch

from minillm.compile import compile_blocks, eager_blocks, is_compiled
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.sampling import SamplingParams
from minillm.stages import KVCacheRunner
from test_paged_torch import tiny_model


def test_compiled_blocks_give_eager_logits_and_can_be_undone():
    model = tiny_model()
    prompt = [5, 9, 200, 17, 3, 44, 81]
    runs = {}
    for name in ("eager", "compiled", "eager again"):
        (compile_blocks if name == "compiled" else eager_blocks)(model)
        assert is_compiled(model) == (name == "compiled")
        runner = KVCacheRunner(model, max_len=32)
        logits = [runner.prefill(prompt)]                                  # a prompt: many tokens
        for t in (7, 250, 1):
            logits.append(runner.decode(t))                                # then one at a time
        runs[name] = torch.stack(logits)
    torch.testing.assert_close(runs["compiled"], runs["eager"], rtol=1e-5, atol=1e-5)
    assert torch.equal(runs["eager again"], runs["eager"])


def test_compiled_engine_steps_of_any_size_give_eager_tokens(tokenizer):
    """Packed steps of different lengths (prefill chunks, mixed, decode only) all go through one graph."""
    model = tiny_model()
    prompts = [[5, 9, 200, 17, 3], list(range(10, 40)), [250], list(range(100, 119))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    for name in ("eager", "compiled"):
        (compile_blocks if name == "compiled" else eager_blocks)(model)
        engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=64, max_num_batched_tokens=12, verbose=False)
        for i, p in enumerate(prompts):
            engine.add_request(i, p, params)
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = o.token_ids
        results[name] = out
    eager_blocks(model)
    assert results["compiled"] == results["eager"]


def test_compiled_blocks_give_eager_greedy_tokens_on_the_real_model(model, tokenizer):
    ids = tokenizer.encode("The history of the printing press begins in")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = generate(model, tokenizer, ids, params, stage="kv").token_ids
    try:
        compiled = generate(compile_blocks(model), tokenizer, ids, params, stage="kv").token_ids
    finally:
        eager_blocks(model)                                                # the session's model stays eager
    assert compiled == eager


def test_the_compile_flag_compiles_the_model_the_commands_load():
    from minillm.cli.common import load
    from minillm.cli.parser import build_parser

    parser = build_parser()
    for argv in (["generate", "hi"], ["chat"], ["serve"], ["bench"]):
        assert not parser.parse_args(argv).compile and parser.parse_args(argv + ["--compile"]).compile
    model, _, _ = load(parser.parse_args(["generate", "hi", "--compile"]))
    assert is_compiled(model)
