"""oneDNN's packed weights for the engine's big CPU steps (`minillm/packed.py`): the same products as
F.linear, dropped when the weight changes, left out for few rows, and the engine's greedy tokens unchanged."""
import pytest
import torch
import torch.nn.functional as F

from minillm import packed
from minillm.config import ModelConfig
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.model import Transformer
from minillm.sampling import SamplingParams

needs_onednn = pytest.mark.skipif(not packed.available(), reason="this PyTorch has no oneDNN linear operators")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape, w_shape", [((9, 64), (48, 64)), ((64, 576), (960, 576)), ((2, 7, 80), (33, 80))])
def test_packed_products_match_f_linear(dtype, x_shape, w_shape):
    if not packed.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (its bfloat16 path needs AVX-512 or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*x_shape, generator=g).to(dtype), torch.randn(*w_shape, generator=g).to(dtype)
    got = packed.product(x, packed.pack(w))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, F.linear(x, w), rtol=tol, atol=tol * 10)


@needs_onednn
def test_a_packing_is_used_only_while_it_holds():
    w = torch.randn(32, 64)
    x = torch.randn(16, 64)
    assert packed.linear(x, w) is None                               # never packed
    packed.keep(w)
    torch.testing.assert_close(packed.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert packed.linear(x[:8], w) is None                           # few rows: the C loops' or F.linear's
    assert packed.linear(x.bfloat16(), w) is None                    # another dtype
    assert packed.linear(x, w.clone()) is None                       # another tensor
    w.mul_(2)                                                        # written in place: the packing is stale
    assert packed.linear(x, w) is None
    packed.keep(w)
    torch.testing.assert_close(packed.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    key = id(w)
    del w                                                            # freed: the packing goes with it
    assert key not in packed._packs
    with torch.inference_mode(), pytest.raises(ValueError, match="inference tensor"):
        packed.keep(torch.randn(32, 64))


@needs_onednn
def test_pack_model_measures_and_packs_every_float_weight():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                vocab_size=128)).eval().requires_grad_(False)
    try:
        result = packed.pack_model(m, force=True)
        assert {"rows", "torch_ms", "packed_ms", "use_packed"} <= set(result) and m.packed is result
        weights = packed.float_weights(m)
        assert len(weights) == 2 * 4 + 1                                 # four per block, and the tied head
        assert all(id(w) in packed._packs for w in weights)
        ids = torch.randint(0, 128, (2, 12))
        with torch.inference_mode():
            on = m(ids)
            packed.unpack_model(m)
            assert not any(id(w) in packed._packs for w in weights)
            torch.testing.assert_close(on, m(ids), rtol=1e-4, atol=1e-4)
    finally:
        packed.unpack_model(m)


@needs_onednn
@pytest.mark.slow
def test_an_engine_with_packed_weights_gives_the_naive_tokens(model, tokenizer):
    """Twelve requests at once: prefill chunks and decode steps of more than 8 rows go through the packed
    weights, and every request still gets its own naive-stage greedy tokens."""
    texts = ["The capital of France is", "1, 2, 3, 4, 5,", "Water boils at", "def add(a, b):",
             "The three primary colors are", "Once upon a time"] * 2
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20, pack_weights=True)
        if not engine.packed["use_packed"]:
            packed.pack_model(model, force=True)                         # slower here, but checked all the same
        for i, p in enumerate(prompts):
            engine.add_request(i, p, params)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        for i, p in enumerate(prompts[:6]):
            assert outs[i] == outs[i + 6] == generate(model, tokenizer, p, params, stage="naive").token_ids
    finally:
        packed.unpack_model(model)


def test_weights_of_a_dtype_this_cpu_cannot_pack_stay_plain(monkeypatch):
    """oneDNN refuses bfloat16 weights on an AVX2-only CPU: a bfloat16 model is then left as it is (and serves
    through F.linear), never an error. Pretended here on any CPU, then checked for real on this one."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                vocab_size=128)).eval().requires_grad_(False).to(torch.bfloat16)
    monkeypatch.setattr(packed, "packs", lambda dtype: dtype == torch.float32)
    assert packed.float_weights(m) == [] and packed.pack_model(m, force=True) is None
    assert "packed" not in m.__dict__
    monkeypatch.undo()
    result = packed.pack_model(m, force=True)
    try:
        assert (result is not None) == packed.packs(torch.bfloat16)
        x = torch.randn(16, 64, dtype=torch.bfloat16)
        w = m.layers[0].attn.wqkv.weight
        got = packed.linear(x, w)
        assert (got is not None) == packed.packs(torch.bfloat16)
    finally:
        packed.unpack_model(m)
