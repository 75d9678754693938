"""oneDNN's packed weights for the engine's big CPU steps (`minillm/backends/packed.py`): the same products as
F.linear, dropped when the weight changes, left out for few rows, and the engine's greedy tokens unchanged."""
import pytest
import torch
import torch.nn.functional as F

from torch import nn

from minillm.backends import apply_backend, matvec, packed
from minillm.backends.layers import CLinear
from minillm.backends.native import c_layers
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


def float_layers(m):
    return [layer for layer in c_layers(m) if isinstance(layer, CLinear)]


def pack_all(m):
    """Pack every float layer of a native model, whatever this machine measured (checked all the same)."""
    for layer in float_layers(m):
        layer.pack()


@needs_onednn
def test_a_packing_is_used_only_while_it_holds():
    w = torch.randn(32, 64)
    layer = nn.Linear(64, 32, bias=False)
    layer.weight = nn.Parameter(w, requires_grad=False)
    layer = CLinear.adopt(layer, c_rows=4)
    x = torch.randn(16, 64)
    assert layer.packing is None                                     # never packed: F.linear
    layer.pack()
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
    calls = []
    real = packed.product
    packed.product = lambda *a: calls.append(1) or real(*a)
    try:
        layer(x)
        layer(x[:5])                                                 # above the C loop's rows: packed too
        assert len(calls) == 2
        torch.testing.assert_close(layer(x[:2]), F.linear(x[:2], w), rtol=1e-4, atol=1e-4)
        assert len(calls) == (2 if matvec.load_library() is not None else 3)   # the C loop's rows, where it builds
        calls.clear()
        layer.weight.mul_(2)                                         # written in place: the packing is stale
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-4, atol=1e-4)
        assert not calls and layer.packing is None
    finally:
        packed.product = real
    with torch.inference_mode(), pytest.raises(ValueError, match="inference tensor"):
        inf = nn.Linear(64, 32, bias=False)
        inf.weight = nn.Parameter(torch.randn(32, 64), requires_grad=False)
        CLinear.adopt(inf, 0).pack()


@needs_onednn
def test_the_native_backend_packs_every_float_weight_where_asked():
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                    vocab_size=128)).eval().requires_grad_(False)
    m = apply_backend(plain, "native", pack_weights=True)
    said = m.backend_report["kernels"]["float32 products"]["chosen"]
    assert "64 rows: packed" in said
    assert len(float_layers(m)) == 2 * 4 + 1                               # four per block, and the tied head
    assert apply_backend(plain, "native").lm_head.packing is None          # not asked: no second copy
    pack_all(m)
    assert all(layer.packing is not None for layer in float_layers(m))
    ids = torch.randint(0, 128, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(m(ids), plain(ids), rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.slow
def test_an_engine_with_packed_weights_gives_the_naive_tokens(model, tokenizer):
    """Twelve requests at once: prefill chunks and decode steps of more than 8 rows go through the packed
    weights, and every request still gets its own naive-stage greedy tokens."""
    texts = ["The capital of France is", "1, 2, 3, 4, 5,", "Water boils at", "def add(a, b):",
             "The three primary colors are", "Once upon a time"] * 2
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fast = apply_backend(model, "native", pack_weights=True)
    pack_all(fast)                                                       # where slower here, checked all the same
    engine = LLMEngine(fast, tokenizer, kv_cache_memory=64 << 20)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    for i, p in enumerate(prompts[:6]):
        assert outs[i] == outs[i + 6] == generate(model, tokenizer, p, params, stage="naive").token_ids


def test_weights_of_a_dtype_this_cpu_cannot_pack_stay_plain(monkeypatch):
    """oneDNN refuses bfloat16 weights on an AVX2-only CPU: a bfloat16 model then keeps its plain weights (and
    serves through F.linear), never an error. Pretended here on any CPU, then checked for real on this one."""
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                    vocab_size=128)).eval().requires_grad_(False).to(torch.bfloat16)
    monkeypatch.setattr(packed, "packs", lambda dtype: dtype == torch.float32)
    m = apply_backend(plain, "native", pack_weights=True)
    assert "packed" not in m.backend_report["kernels"]["bfloat16 products"]["chosen"]
    assert all(layer.packing is None for layer in float_layers(m))
    monkeypatch.undo()
    m = apply_backend(plain, "native", pack_weights=True)
    said = m.backend_report["kernels"]["bfloat16 products"]["chosen"]
    assert ("64 rows: packed" in said) == packed.packs(torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(m.layers[0].attn.wqkv(x), F.linear(x, plain.layers[0].attn.wqkv.weight))


@needs_onednn
def test_a_model_prepared_with_packed_weights_is_served_as_prepared(tokenizer):
    """LLM and apply_backend with no word on packing keep a model prepared for the backend as it is: a
    packed model given to LLM stays packed (it was prepared again, unpacked, and its big steps went to
    F.linear); asked for packing explicitly, as asked."""
    from minillm import LLM

    torch.manual_seed(0)
    plain = Transformer(ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                    vocab_size=tokenizer.vocab_size)).eval().requires_grad_(False)
    fast = apply_backend(plain, "native", pack_weights=True)
    pack_all(fast)
    llm = LLM(fast, tokenizer, kv_cache_memory=16 << 20, verbose=False)
    assert llm.model is fast and all(layer.packing is not None for layer in float_layers(llm.model))
    assert apply_backend(fast, "native") is fast and apply_backend(fast, "auto") is fast
    unpacked = apply_backend(fast, "native", pack_weights=False)
    assert unpacked is not fast and all(layer.packing is None for layer in float_layers(unpacked))
    assert LLM(plain, tokenizer, kv_cache_memory=16 << 20, verbose=False).model.backend_report["pack_weights"] is False
