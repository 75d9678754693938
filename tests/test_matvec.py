"""The few-row matrix product in C (`minillm/backends/matvec.c`): against float64 on ragged shapes, what the
native backend's layers leave to torch, and the real model's greedy tokens with it forced on."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minillm.backends import apply_backend, matvec, races
from minillm.backends.layers import CLinear
from minillm.backends.native import settings

needs_c = pytest.mark.skipif(matvec.load_library() is None, reason="no C compiler builds the matvec loop here")


@needs_c
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("out_features, in_features", [(1, 16), (7, 48), (13, 576), (960, 576), (576, 1536)])
def test_matches_float64(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    ref = x.double() @ w.double().T
    got = matvec.matvec(x, w)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@needs_c
@pytest.mark.parametrize("rows", [1, 3])
def test_bfloat16_weights(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    w = torch.randn(1000, 576, generator=g).bfloat16()
    got = matvec.matvec(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-2, atol=5e-2)   # bfloat16's rounding


def c_linear(w: torch.Tensor, c_rows: int) -> CLinear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight = nn.Parameter(w, requires_grad=w.requires_grad)
    return CLinear.adopt(layer, c_rows)


@needs_c
def test_linear_sends_only_what_the_loop_takes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 576, generator=g)
    layer = c_linear(w, matvec.MAX_ROWS)                                 # forced on: up to 8 rows in C
    x = torch.randn(2, 1, 576, generator=g)                              # (B, T, in): leading dims kept
    assert layer(x).shape == (2, 1, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    for x in (torch.randn(9, 576, generator=g),                          # more rows than MAX_ROWS (8)
              torch.randn(1, 50, generator=g)):                          # in_features not a multiple of 16
        wx = torch.randn(64, x.shape[1], generator=g)
        assert torch.equal(c_linear(wx, matvec.MAX_ROWS)(x), F.linear(x, wx))   # torch's kernel, bit for bit
    wg = c_linear(w.clone().requires_grad_(), matvec.MAX_ROWS)
    y = wg(torch.randn(1, 576, generator=g))                             # autograd needs torch's op
    y.sum().backward()
    assert wg.weight.grad is not None
    x = torch.randn(1, 576, generator=g)
    assert torch.equal(c_linear(w, 0)(x), F.linear(x, w))                # off: torch's kernel


def test_the_race_result():
    assert races.float_products(torch.float16) is None                  # not a dtype the loop takes
    c = races.float_products(torch.float32)
    if matvec.load_library() is not None:
        assert set(c) == {"torch_ms_1", "c_ms_1", "torch_ms_8", "c_ms_8", "bytes", "use_c", "max_rows", "remembered"}
        assert c["c_ms_1"] > 0 and c["max_rows"] in (0, 4, 8) and c["use_c"] == (c["max_rows"] > 0)


@needs_c
@pytest.mark.slow
def test_kv_stage_with_the_loop_gives_the_naive_tokens(model, tokenizer):
    """Forced on, whatever this machine measured: every decode step's products go through the C loop."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    params = SamplingParams(max_tokens=32)
    fast = apply_backend(model, "native")
    for text in ["The history of the printing press begins in", "def fibonacci(n):"]:
        ids = tokenizer.encode(text)
        naive = generate(model, tokenizer, ids, params, stage="naive").token_ids
        with settings(fast, c_rows=matvec.MAX_ROWS, blocks=False):
            assert generate(fast, tokenizer, ids, params, stage="kv").token_ids == naive


@needs_c
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_products_match_float64(rows, out_features, in_features, dtype):
    """int8 rows and Q4_1 blocks (in the C loop's tiles), against their own weights in float64."""
    from minillm.quant.linear import Int8Linear, quantize_q4_1

    g = torch.Generator().manual_seed(rows * 7 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g)
    i8, q4 = Int8Linear.from_float(w, kernel=False), quantize_q4_1(w, 64 if in_features % 64 == 0 else 32)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)   # bfloat16 out
    for got, weight in [(matvec.matvec_int8(x, i8.q, i8.scale), i8.dequantize()),
                        (matvec.matvec_q4_1(x, *matvec.q4_tiles(q4.codes(), *q4.per_block())), q4.dequantize())]:
        assert got.shape == (rows, out_features) and got.dtype == dtype
        torch.testing.assert_close(got.double(), x.double() @ weight.double().T, **tol)


def test_q4_tiles_layout():
    """Tile t, block g, byte [p][r]: row 16 t + r's weights 2p (low nibble) and 2p + 1 (high) of block g."""
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    d = torch.arange(64, dtype=torch.float16).view(32, 2)
    tiles, dt, _ = matvec.q4_tiles(codes, d, d)
    assert tiles.shape == (2, 2, 16, 16) and dt.shape == (2, 2, 16)
    t, g, p, r = 1, 1, 5, 3
    row, col = 16 * t + r, 32 * g + 2 * p
    assert tiles[t, g, p, r] == codes[row, col] | (codes[row, col + 1] << 4)
    assert dt[t, g, r] == d[row, g]


@needs_c
def test_race_and_quantized_layers_choose_by_measurement():
    """The native backend times a model's own int8 and Q4_1 layers against torch's kernels and gives each
    layer the row count the C loops won up to; `settings` forces either side."""
    from minillm.config import ModelConfig
    from minillm.model import Transformer
    from minillm.quant.apply import quantize_model

    calls = []
    r = races.race({"torch": lambda rows: calls.append(("torch", rows)), "c": lambda rows: calls.append(("c", rows))},
                   rounds=2)
    assert {"torch_ms_1", "c_ms_1", "torch_ms_8", "c_ms_8", "use_c", "max_rows"} <= set(r)
    assert calls[:2] == [("torch", 1), ("c", 1)] and len(calls) == 12       # turns, a warm-up round each
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=64, vocab_size=96)
    plain = quantize_model(Transformer(cfg).eval().requires_grad_(False), "q4", progress=False)
    m = apply_backend(plain, "native", remember=False)
    kernels = m.backend_report["kernels"]
    assert {"int8 products", "q4_1 products"} <= set(kernels)
    layer = m.layers[0].mlp.w_down
    assert layer.c_rows == kernels["q4_1 products"]["measured"]["max_rows"]
    assert m.lm_head.c_rows == kernels["int8 products"]["measured"]["max_rows"]
    assert not hasattr(plain.layers[0].mlp.w_down, "c_tiles")              # the plain model stays plain
    x = torch.randn(1, 64)
    with settings(m, c_rows=matvec.MAX_ROWS):
        torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize()), rtol=1e-5, atol=1e-5)
