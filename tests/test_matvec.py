"""The few-row matrix product in C (`minillm/matvec.c`): against float64 on ragged shapes, what it leaves to
torch, and the real model's greedy tokens with it forced on."""
import pytest
import torch
import torch.nn.functional as F

from minillm import matvec

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


@needs_c
def test_linear_sends_only_what_the_loop_takes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 576, generator=g)
    with matvec.using("c"):
        x = torch.randn(2, 1, 576, generator=g)                          # (B, T, in): leading dims kept
        assert matvec.linear(x, w).shape == (2, 1, 64)
        torch.testing.assert_close(matvec.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        for x in (torch.randn(9, 576, generator=g),                      # more rows than MAX_ROWS (8)
                  torch.randn(1, 50, generator=g)):                      # in_features not a multiple of 16
            wx = torch.randn(64, x.shape[1], generator=g)
            assert torch.equal(matvec.linear(x, wx), F.linear(x, wx))    # torch's kernel, bit for bit
        wg = w.clone().requires_grad_()
        y = matvec.linear(torch.randn(1, 576, generator=g), wg)          # autograd needs torch's op
        y.sum().backward()
        assert wg.grad is not None
    with matvec.using("torch"):
        x = torch.randn(1, 576, generator=g)
        assert torch.equal(matvec.linear(x, w), F.linear(x, w))


def test_choice_and_modes():
    with pytest.raises(ValueError, match="'auto', 'c' or 'torch'"):
        with matvec.using("fast"):
            pass
    assert matvec.choice(torch.float16) is None                          # not a dtype the loop takes
    c = matvec.choice(torch.float32)
    if matvec.load_library() is not None:
        assert set(c) == {"torch_ms_1", "c_ms_1", "torch_ms_8", "c_ms_8", "bytes", "use_c", "max_rows"}
        assert c["c_ms_1"] > 0 and c["max_rows"] in (0, 4, 8) and c["use_c"] == (c["max_rows"] > 0)


@needs_c
@pytest.mark.slow
def test_kv_stage_with_the_loop_gives_the_naive_tokens(model, tokenizer):
    """Forced on, whatever this machine measured: every decode step's products go through the C loop."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    params = SamplingParams(max_tokens=32)
    for text in ["The history of the printing press begins in", "def fibonacci(n):"]:
        ids = tokenizer.encode(text)
        naive = generate(model, tokenizer, ids, params, stage="naive").token_ids
        with matvec.using("c"):
            assert generate(model, tokenizer, ids, params, stage="kv").token_ids == naive
