"""Speculative decoding on the real model: greedy output identical to plain decoding, for every
proposer and draft length, single-stream; rollback leaves the caches as if the drafts never ran."""
import pytest
import torch
from helpers import pool_io

from minillm.generate import generate
from minillm.stages import make_runner
from minillm.sampling import SamplingParams
from minillm.speculative import DraftModelProposer, LayerSkipProposer, NgramProposer, Proposer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PASSAGE = [{"role": "user", "content": "Repeat this sentence exactly: the red fox jumps over the lazy brown dog "
                                       "and runs into the green forest."}]


class Oracle(Proposer):
    """Proposes a known continuation (optionally with one wrong token): drafts that hit exactly where
    a test wants them to, EOS included."""
    name = "oracle"

    def __init__(self, prompt_len: int, continuation: list[int], wrong_at: int | None = None):
        self.P, self.cont, self.wrong_at = prompt_len, continuation, wrong_at

    def start(self, runner, params, generator):
        pass

    def propose(self, token_ids, k):
        done = len(token_ids) - self.P                     # output tokens so far
        drafts = list(self.cont[done:done + k])
        if self.wrong_at is not None and done <= self.wrong_at < done + len(drafts):
            drafts[self.wrong_at - done] = (drafts[self.wrong_at - done] + 1) % 1000
        return drafts, None


@pytest.fixture(scope="module")
def refs(model, tokenizer):
    """Plain greedy decoding (the kv stage, itself equal to naive): the answer each test must reproduce."""
    out = {}
    for name, msgs, n in [("question", QUESTION, 40), ("passage", PASSAGE, 40)]:
        ids = tokenizer.apply_chat_template(msgs)
        out[name] = (ids, generate(model, tokenizer, ids, SamplingParams(max_tokens=n), stage="kv"))
    return out


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("proposer", ["ngram", "layers:20", "draft"])
def test_greedy_output_is_unchanged(backend_model, tokenizer, refs, proposer, k):
    ids, ref = refs["passage"]                # on the torch backend; each backend must reproduce it
    spec = DraftModelProposer(backend_model) if proposer == "draft" else proposer
    g = generate(backend_model, tokenizer, ids, SamplingParams(max_tokens=40), stage="kv",
                 adaptive_speculation=False, speculative=spec, num_speculative_tokens=k)
    assert g.token_ids == ref.token_ids and g.text == ref.text and g.finish_reason == ref.finish_reason
    assert g.spec_drafts > 0 and g.spec_accepted_tokens <= g.spec_draft_tokens <= k * g.spec_drafts
    if proposer == "draft":                  # the draft is the model itself: every draft is accepted, but drafts
        # accepted past the answer's end of text are never emitted, and not counted
        assert g.acceptance_rate == 1.0 or (ref.finish_reason == "stop" and g.acceptance_rate > 0.8)
    if proposer == "ngram":                  # the answer copies the prompt: lookups hit
        assert g.acceptance_rate > 0.5


def test_eos_inside_a_draft_and_as_the_bonus(model, tokenizer, refs):
    ids, ref = refs["question"]
    assert ref.finish_reason == "stop"
    eos = tokenizer.im_end_id
    cont = ref.token_ids + [eos, 17, 18, 19]
    n = len(ref.token_ids)
    for k in (3, 5, 8):
        # drafts run past the end: EOS is accepted inside a draft and the tokens after it are dropped
        g = generate(model, tokenizer, ids, SamplingParams(max_tokens=40), stage="kv",
                     adaptive_speculation=False, speculative=Oracle(len(ids), cont), num_speculative_tokens=k)
        assert (g.token_ids, g.text, g.finish_reason) == (ref.token_ids, ref.text, "stop")
        assert g.spec_accepted_tokens <= len(g.token_ids)      # drafts accepted past the end are not counted
    # drafts that end just before EOS, all accepted: EOS comes as the bonus token
    g = generate(model, tokenizer, ids, SamplingParams(max_tokens=40), stage="kv",
                 adaptive_speculation=False, speculative=Oracle(len(ids), ref.token_ids), num_speculative_tokens=n - 1)
    assert (g.token_ids, g.finish_reason) == (ref.token_ids, "stop")
    # a wrong draft is corrected by the target
    g = generate(model, tokenizer, ids, SamplingParams(max_tokens=40), stage="kv",
                 adaptive_speculation=False, speculative=Oracle(len(ids), cont, wrong_at=2), num_speculative_tokens=4)
    assert g.token_ids == ref.token_ids and g.spec_accepted_tokens < g.spec_draft_tokens


def test_max_tokens_in_the_middle_of_an_accepted_run(model, tokenizer, refs):
    ids, ref = refs["passage"]
    for max_tokens in (1, 2, 7):
        g = generate(model, tokenizer, ids, SamplingParams(max_tokens=max_tokens), stage="kv",
                     adaptive_speculation=False, speculative=Oracle(len(ids), ref.token_ids), num_speculative_tokens=5)
        assert g.token_ids == ref.token_ids[:max_tokens] and g.finish_reason == "length"


def test_stop_string_inside_an_accepted_run(model, tokenizer, refs):
    ids, ref = refs["passage"]
    stop = ref.text[10:14]
    plain = generate(model, tokenizer, ids, SamplingParams(max_tokens=40, stop=[stop]), stage="kv")
    g = generate(model, tokenizer, ids, SamplingParams(max_tokens=40, stop=[stop]), stage="kv",
                 adaptive_speculation=False, speculative=Oracle(len(ids), ref.token_ids), num_speculative_tokens=8)
    assert (g.text, g.finish_reason) == (plain.text, "stop")


@pytest.mark.parametrize("stage", ["flash", "paged"])
def test_triton_stages(model, tokenizer, refs, stage):
    """The flash and paged stages (Triton kernels, interpreted on a CPU: slow, so a short run)."""
    ids, ref = refs["passage"]
    g = generate(model, tokenizer, ids, SamplingParams(max_tokens=6), stage=stage,
                 adaptive_speculation=False, speculative="ngram", num_speculative_tokens=3)
    assert g.token_ids == ref.token_ids[:6] and g.spec_accepted_tokens > 0


def test_sampled_speculation_is_seeded(model, tokenizer, refs):
    ids, _ = refs["question"]
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=3)
    a = generate(model, tokenizer, ids, p, stage="kv", adaptive_speculation=False,
                 speculative="layers:20", num_speculative_tokens=3)
    b = generate(model, tokenizer, ids, p, stage="kv", adaptive_speculation=False,
                 speculative="layers:20", num_speculative_tokens=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


@pytest.mark.parametrize("stage", ["kv", "paged"])
def test_rollback_equals_never_seeing_the_drafts(stage):
    """K/V after extend(drafts) + truncate equal K/V of a cache that only ever saw the kept tokens
    (up to float rounding: the kept tokens were computed in a pass of 7 rows instead of 2). The cache's
    bookkeeping, so a tiny random model does (the paged stage's kernels run interpreted)."""
    from test_paged_torch import tiny_model

    model = tiny_model()
    torch.manual_seed(0)
    prompt = torch.randint(0, 300, (21,)).tolist()
    kept, rejected = [11, 12], [13, 14, 15, 16, 17]         # 16 + 21 crosses a block boundary (block 16)
    a, b = make_runner(model, stage, max_len=48), make_runner(model, stage, max_len=48)
    a.prefill(prompt)
    a.extend(kept + rejected)
    a.truncate(len(prompt) + len(kept))
    b.prefill(prompt)
    b.extend(kept)
    assert a.length == b.length == len(prompt) + len(kept)
    la, lb = a.extend([42]), b.extend([42])                  # the next step reads the same cache
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    n = a.length
    if stage == "kv":
        torch.testing.assert_close(a.cache.k[:, :, :, :n], b.cache.k[:, :, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.cache.v[:, :, :, :n], b.cache.v[:, :, :, :n], rtol=1e-4, atol=1e-4)
    else:
        assert len(a.pool.tables[0]) == len(b.pool.tables[0]) == a.pool.blocks_for(n)
        assert a.pool.num_free_blocks == b.pool.num_free_blocks          # blocks past the kept ones came back
        for layer in (0, model.cfg.n_layers - 1):
            for x, y in zip(pool_io.gather(a.pool, layer, 0), pool_io.gather(b.pool, layer, 0)):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["draft:q4", "ngram+draft:int8"])
def test_quantized_copy_drafts(model, tokenizer, refs, spec):
    """The model's own quantized copy as the draft (alone, or after an n-gram lookup): the plain greedy
    answer, most drafts accepted (the copy agrees with the model on most tokens)."""
    for name in ("question", "passage"):
        ids, ref = refs[name]
        g = generate(model, tokenizer, ids, SamplingParams(max_tokens=40), stage="kv", adaptive_speculation=False,
                     speculative=spec,
                     num_speculative_tokens=4)
        assert g.token_ids == ref.token_ids and g.text == ref.text
        assert g.acceptance_rate > 0.5
    from minillm.speculative import quantized_copy

    assert quantized_copy(model, "q4") is quantized_copy(model, "q4")      # made once per model and format
    with pytest.raises(ValueError, match="already quantized"):
        quantized_copy(quantized_copy(model, "int8"), "q4")


def test_bad_speculative_settings(model, tokenizer, refs):
    ids, _ = refs["question"]
    for spec, k, stage, msg in [("bogus", 3, "kv", "unknown speculative proposer"),
                                ("layers:30", 3, "kv", "fewer layers"),
                                ("layers:x", 3, "kv", "bad speculative proposer"),
                                ("draft:q3", 3, "kv", "unknown quantization"),
                                ("draft+ngram", 3, "kv", "a cascade is"),
                                ("ngram", 0, "kv", "num_speculative_tokens"),
                                ("ngram", 3, "naive", "KV cache")]:
        with pytest.raises(ValueError, match=msg):
            generate(model, tokenizer, ids, SamplingParams(max_tokens=4), stage=stage,
                     adaptive_speculation=False, speculative=spec, num_speculative_tokens=k)
    assert NgramProposer().name == "ngram[1-4]" and LayerSkipProposer(3).name == "layers:3"


@pytest.mark.parametrize("proposer, k", [("ngram", 4), ("layers:20", 3), ("draft", 4)])
def test_adaptive_speculation_gives_the_same_greedy_output(model, tokenizer, refs, proposer, k):
    """Each step drafts 0..k tokens as the sequence's acceptance and the measured pass costs say; what is
    emitted is the plain answer whatever is chosen. Costs are given here so the run drafts: passes over 2..k+1
    tokens as cheap as one (a GPU's picture), and the answer copies its prompt; then with the costs measured
    on this machine, whatever they say."""
    ids, ref = refs["passage"]
    spec = DraftModelProposer(model) if proposer == "draft" else proposer
    free = {T: 1.0 for T in range(1, k + 2)}
    from minillm.speculative.decode import speculative_decode
    from minillm.detokenizer import IncrementalDetokenizer
    from minillm.generate import Generation

    params = SamplingParams(max_tokens=40)
    out = Generation(prompt_tokens=len(ids))
    detok = IncrementalDetokenizer(tokenizer, params, 40)
    out.token_ids = detok.token_ids
    list(speculative_decode(model, ids, params, "kv", spec, k, detok, out, adaptive=True, pass_cost=free))
    assert out.token_ids == ref.token_ids and out.text == ref.text
    if proposer == "draft":                 # a draft as costly as the target never pays: plain decoding
        assert out.spec_drafts == 0
    else:
        assert out.spec_drafts > 0
    g = generate(model, tokenizer, ids, params, stage="kv", speculative=spec, num_speculative_tokens=k,
                 adaptive_speculation=True)                 # costs measured on this machine
    assert g.token_ids == ref.token_ids


def test_adaptive_sampled_run_is_seeded(model, tokenizer, refs):
    ids, _ = refs["question"]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    a, b = (generate(model, tokenizer, ids, params, stage="kv", speculative="ngram", num_speculative_tokens=4,
                     adaptive_speculation=True) for _ in range(2))
    assert a.token_ids == b.token_ids


def test_one_stream_drafts_adaptively_unless_told_otherwise(model, tokenizer, refs, monkeypatch):
    import minillm.speculative.decode as decode
    asked = []
    real = decode.speculative_decode
    monkeypatch.setattr(decode, "speculative_decode", lambda *a: asked.append(a[9]) or real(*a))
    ids, _ = refs["question"]
    for adaptive in (None, False, True):
        generate(model, tokenizer, ids, SamplingParams(max_tokens=2), stage="kv", speculative="ngram",
                 adaptive_speculation=adaptive)
    assert asked == [True, False, True]


def test_adaptive_speculation_needs_a_proposer(model, tokenizer, refs):
    ids, _ = refs["question"]
    for stage in ("kv", "continuous"):
        with pytest.raises(ValueError, match="speculative"):
            generate(model, tokenizer, ids, SamplingParams(max_tokens=4), stage=stage, adaptive_speculation=True)
