"""CUDA graphs for decode steps. Without a GPU: the ladder of sizes, the padding, and the static step
(the one a graph records) against the engine's usual step, run eagerly through the Triton interpreter.
With a GPU: greedy tokens with and without graphs on the real model."""
import pytest
import torch

from minillm.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from minillm.sampling import SamplingParams
from test_paged_torch import tiny_model

PROMPTS = [[5, 9, 200, 17, 3], list(range(10, 40)), [250], list(range(100, 119)), [7, 7]]


@pytest.mark.parametrize("max_batch, sizes", [(1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 32]),
                                              (64, [1, 2, 4, 8, 16, 32, 48, 64])])
def test_the_ladder_of_sizes(max_batch, sizes):
    assert capture_sizes(max_batch) == sizes


def test_a_batch_runs_in_the_smallest_size_that_holds_it():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 48, 64]
    for n in (0, 65):
        with pytest.raises(ValueError, match="does not fit"):
            padded_size(n, sizes)


def _pool(num_blocks=64, block_size=4):
    from minillm.kv import BlockPool

    model = tiny_model()
    return model, BlockPool(model.cfg, num_blocks, block_size, model.dtype, model.device)


@pytest.mark.triton
def test_padding_rows_write_nothing_and_read_nothing():
    model, pool = _pool()
    graphs = DecodeGraphs(model, pool, max_batch=8, max_len=64)
    size = graphs.fill([11, 12, 13], [5, 0, 9], [[3, 7], [2], [4, 8, 1]])
    assert size == 4
    assert graphs.ids[:4].tolist() == [11, 12, 13, 0]
    b = graphs.buffers                                                            # the attention backend's
    assert b["slots"][:4].tolist() == [7 * 4 + 1, 2 * 4, 1 * 4 + 1, -1]       # page p // 4, row p % 4
    assert b["k_lens"][:4].tolist() == [6, 1, 10, 0]
    assert b["table"][:4, :3].tolist() == [[3, 7, 0], [2, 0, 0], [4, 8, 1], [0, 0, 0]]
    with pytest.raises(ValueError, match="longer than the 64 tokens"):
        graphs.fill([1], [70], [list(range(18))])


def _run_engine(model, tokenizer, graphs: str | None):
    """Greedy answers of the engine; graphs: None (its usual step), "eager" (the static step, uncaptured),
    or "fake" (replays of a stand-in graph that runs the static step on the buffers as they are then)."""
    from minillm.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, attention="triton", block_size=4, num_blocks=64, max_num_batched_tokens=12,
                       max_num_seqs=4, verbose=False)
    if graphs:
        engine.runner.use_decode_graphs(4, engine.max_len, eager=True)
    if graphs == "fake":
        g = engine.runner.graphs

        class Replay:
            def __init__(self, size):
                self.size, self.out = size, torch.empty(size, model.cfg.vocab_size)

            def replay(self):
                self.out.copy_(g._step(self.size))

        g.graphs = {n: (r, r.out) for n, r in ((n, Replay(n)) for n in g.sizes)}
        g.eager = False
    static_steps = []
    if graphs:
        real = engine.runner.graphs.run
        engine.runner.graphs.run = lambda *a: static_steps.append(len(a[0])) or real(*a)
    for i, p in enumerate(PROMPTS):
        engine.add_request(i, p, SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [finals[i] for i in range(len(PROMPTS))], static_steps


@pytest.mark.triton
def test_the_static_step_gives_the_engine_s_tokens(tokenizer):
    """Five requests, at most four at a time, prompts chunked: mixed steps run as usual, decode-only
    steps of 1 to 4 requests (padded to 1, 2 or 4) run as the graph would, eagerly and replayed."""
    model = tiny_model()
    usual, _ = _run_engine(model, tokenizer, None)
    for mode in ("eager", "fake"):
        tokens, steps = _run_engine(model, tokenizer, mode)
        assert tokens == usual, mode
        assert 3 in steps and 4 in steps, (mode, steps)   # decode-only steps went through the buffers, padded


@pytest.mark.triton
def test_the_flash_stage_s_static_step_gives_its_tokens():
    """Stage flash's decode step as a graph records it (ragged lengths written at their positions of the
    contiguous cache), run eagerly: the stage's own tokens and logits."""
    from minillm.stages import FlashRunner

    model = tiny_model()

    def run(static):
        runner = FlashRunner(model, max_len=40)
        runner.cuda_graphs = static                  # on a CPU: the static step, uncaptured
        logits, tokens = runner.prefill_batch([PROMPTS[0], PROMPTS[2], PROMPTS[3]]), []
        for _ in range(6):
            tokens.append(logits.argmax(-1).tolist())
            logits = runner.decode_batch(tokens[-1])
        assert (runner._graph is not None) == static
        return tokens, logits

    usual, static = run(False), run(True)
    assert usual[0] == static[0]
    torch.testing.assert_close(usual[1], static[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_give_the_eager_greedy_tokens_on_a_gpu(model, tokenizer):
    from minillm.engine import LLMEngine

    gpu = model.to("cuda")
    try:
        answers = {}
        for eager in (False, True):
            engine = LLMEngine(gpu, tokenizer, max_num_seqs=8, enforce_eager=eager, verbose=False)
            assert (engine.runner.graphs is None) == eager
            for i, p in enumerate(["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]):
                engine.add_request(i, tokenizer.encode(p), SamplingParams(max_tokens=16, ignore_eos=True))
            finals = {}
            while engine.has_unfinished_requests():
                finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            answers[eager] = finals
        assert answers[False] == answers[True]
        from minillm.generate import generate

        ids = tokenizer.encode("The capital of France is")
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        flash = [generate(gpu, tokenizer, ids, params, stage="flash", enforce_eager=e).token_ids for e in (False, True)]
        assert flash[0] == flash[1]
    finally:
        model.to("cpu")
