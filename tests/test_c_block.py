"""A block's two halves in one C call each, and the whole block with attention over a contiguous cache
(`minillm/backends/c_block.py`): the same numbers as the block's own PyTorch code for every weight format it takes,
the cases it leaves to PyTorch, and the 4-bit file's greedy tokens equal to the same weights' float32
arithmetic."""
import copy

import pytest
import torch

from torch import nn

from minillm.backends import apply_backend, c_block, matvec
from minillm.backends.native import c_layers, settings
from minillm.config import ModelConfig
from minillm.model import Transformer, rope_tables
from minillm.attention import naive_attention
from minillm.kv import CachedAttention, KVCache
from minillm.quant.apply import LINEARS, quantize_model
from minillm.stages import KVCacheRunner

needs_c = pytest.mark.skipif(c_block.load_library() is None, reason="no C compiler builds the block here")
CFG = ModelConfig(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=256)


def tiny(quant, backend="native"):
    """The tiny model (quantized), with the native backend's C layers and blocks, every product forced into
    C whatever this machine measured (each test makes its own model)."""
    torch.manual_seed(0)
    m = Transformer(CFG).eval().requires_grad_(False)
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    m = quantize_model(m, quant, progress=False) if quant else m
    if backend == "torch":
        return m
    m = apply_backend(m, backend)
    for layer in c_layers(m):
        layer.c_rows = matvec.MAX_ROWS
    return m


def inputs(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, CFG.d_model, generator=g)
    pos = torch.arange(T) + 5 if B == 1 else torch.randint(0, 50, (B, T), generator=g)   # ragged positions
    cos, sin = rope_tables(CFG.head_dim, pos, CFG.rope_base)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]                                            # (B, 1, T, hd)
    return x, cos, sin, torch.randn(B, CFG.n_heads, T, CFG.head_dim, generator=g)


@needs_c
@pytest.mark.parametrize("quant", [None, "int8", "q4"])
@pytest.mark.parametrize("B, T", [(1, 1), (1, 3), (4, 1), (2, 4)])
@torch.inference_mode()
def test_halves_match_the_blocks_own_code(quant, B, T):
    m = tiny(quant)
    block = m.layers[1]
    x, cos, sin, out = inputs(B, T)
    with settings(m, blocks=False):           # the same products either way: what differs is the rest
        ref = [*block.before_attention(x, cos, sin), block.after_attention(x, out)]
    got = [*c_block.before_attention(block, x, cos, sin), c_block.after_attention(block, x, out)]
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@needs_c
@torch.inference_mode()
def test_what_it_leaves_to_pytorch():
    m = tiny(None)
    block = m.layers[0]
    x, cos, sin, _ = inputs(1, 1)
    assert c_block.before_attention(block, x, cos, sin) is not None
    assert c_block.before_attention(block, x.bfloat16(), cos, sin) is None          # float32 only
    x9, cos9, sin9, _ = inputs(1, 9)
    assert c_block.before_attention(block, x9, cos9, sin9) is None                 # more rows than 8
    with settings(m, blocks=False):
        assert c_block.before_attention(block, x, cos, sin) is None
    with settings(m, c_rows=0):                                                    # torch's products
        assert c_block.before_attention(block, x, cos, sin) is None
    w8a8 = apply_backend(quantize_model(tiny(None, "torch"), "w8a8", progress=False), "native")
    with settings(w8a8, c_rows=matvec.MAX_ROWS):                                   # no C product for it
        assert c_block.before_attention(w8a8.layers[0], x, cos, sin) is None


@needs_c
@torch.inference_mode()
def test_a_replaced_weight_is_described_again():
    block = tiny(None).layers[0]
    x, cos, sin, _ = inputs(1, 1)
    before = c_block.before_attention(block, x, cos, sin)[0].clone()
    block.attn.wqkv.weight = torch.nn.Parameter(block.attn.wqkv.weight * 2, requires_grad=False)
    after = c_block.before_attention(block, x, cos, sin)[0]
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-5)                # RoPE is linear


@needs_c
@pytest.mark.parametrize("quant", [None, "int8", "q4"])
@pytest.mark.parametrize("B, T", [(1, 1), (1, 3), (3, 1), (2, 4)])
@torch.inference_mode()
def test_the_whole_block_matches_pytorch_and_fills_the_same_cache(quant, B, T, monkeypatch):
    """A step of T tokens after a prompt of 6 (1 x 6 rows: C from the prompt on): the logits, and every K
    and V the cache holds, as PyTorch's blocks with SDPA give them."""
    m = tiny(quant)
    g = torch.Generator().manual_seed(B * 10 + T)
    prompt, new = torch.randint(0, 256, (B, 6), generator=g).tolist(), torch.randint(0, 256, (B, T), generator=g)
    calls = []
    monkeypatch.setattr(c_block, "_call", lambda name, real=c_block._call, **a: calls.append(name) or real(name, **a))
    got = {}
    for on in (True, False):
        runner = KVCacheRunner(m, max_len=16)
        with settings(m, blocks=on):
            runner.prefill_batch(prompt)
            got[on] = (runner._forward(new), runner.cache.k.clone(), runner.cache.v.clone())
    assert calls.count("block_layer") == CFG.n_layers * (1 + (B == 1))      # this step, and a 1 x 6 prompt
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_c
@torch.inference_mode()
def test_attention_it_leaves_to_pytorch():
    """The whole block takes only a context whose attention is causal SDPA over a plain float32 cache."""
    m = tiny(None)
    cache = KVCache(CFG, batch=2, max_len=16)
    cache.begin(1)
    assert CachedAttention(cache, torch.nn.functional.scaled_dot_product_attention).in_place(0) is None
    assert CachedAttention(cache, naive_attention).in_place(0) is None                  # another attention
    from minillm.attention import sdpa_attention
    assert CachedAttention(cache, sdpa_attention).in_place(0) is not None
    assert CachedAttention(cache, sdpa_attention, mask=torch.ones(2, 1, 1, 1, dtype=torch.bool)).in_place(0) is None
    int8 = KVCache(CFG, batch=2, max_len=16, kv_dtype="int8")
    int8.begin(1)
    assert int8.in_place(0) is None                                                    # quantized K/V
    bf16 = KVCache(CFG, batch=2, max_len=16, dtype=torch.bfloat16)
    bf16.begin(1)
    assert bf16.in_place(0) is None
    x, cos, sin, _ = inputs(3, 1)                                                      # 3 sequences, cache of 2
    assert c_block.layer(m.layers[0], x, cos, sin, CachedAttention(cache, sdpa_attention), 0) is None


def as_float32(model):
    """The same weights as plain float32 Linear layers: the arithmetic the C path does, done by PyTorch."""
    f = copy.deepcopy(model)
    for block in f.layers:
        for part, name in LINEARS:
            q = getattr(getattr(block, part), name)
            layer = nn.Linear(q.in_features, q.out_features, bias=False)
            layer.weight = torch.nn.Parameter(q.dequantize(), requires_grad=False)
            setattr(getattr(block, part), name, layer)
    head = nn.Linear(f.lm_head.in_features, f.lm_head.out_features, bias=False)
    head.weight = torch.nn.Parameter(f.lm_head.dequantize(), requires_grad=False)
    f.lm_head = head
    return f


@needs_c
@pytest.mark.slow
def test_the_4bit_file_gives_its_float32_arithmetics_tokens(quantized, tokenizer):
    """q4_file through the C block (float32 activations, the file's weights) against the naive stage on the
    same weights dequantized to float32: the same greedy tokens."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    ref_model = as_float32(quantized["q4_file"])
    q4 = apply_backend(quantized["q4_file"], "native")
    params = SamplingParams(max_tokens=32)
    for text in ["The history of the printing press begins in", "def fibonacci(n):"]:
        ids = tokenizer.encode(text)
        with settings(q4, c_rows=matvec.MAX_ROWS, blocks=True):
            assert (generate(q4, tokenizer, ids, params, stage="kv").token_ids
                    == generate(ref_model, tokenizer, ids, params, stage="naive").token_ids)
