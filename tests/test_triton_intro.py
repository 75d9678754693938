"""Notebook 05's teaching kernels under the Triton interpreter (conftest sets TRITON_INTERPRET=1 before
triton loads): the row scale against torch, the one-head FlashAttention against a float64 reference."""
import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (Linux only): pip install triton")

from minillm.attention import naive_attention  # noqa: E402
from minillm.course.triton_intro import flash_attention_one_head, scale_rows  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("R, C, block_r", [(1, 1, 4), (10, 5, 4), (16, 16, 4), (7, 33, 2)])
def test_scale_rows_matches_torch(R, C, block_r):
    g = torch.Generator().manual_seed(R * 100 + C)
    x = torch.randn(R, C, generator=g)
    w = torch.randn(R, generator=g)
    out = scale_rows(x, w, block_r=block_r)
    assert torch.equal(out, x * w[:, None]), (out - x * w[:, None]).abs().max()


def test_scale_rows_follows_the_row_stride_of_a_view():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(10, 7, generator=g)
    x = big[:, 1:6]                                   # (10, 5), rows 7 floats apart
    w = torch.randn(10, generator=g)
    assert torch.equal(scale_rows(x, w), x * w[:, None])


def reference(q, k, v, causal):
    """float64 naive attention for one head: q (T, D), k, v (S, D) -> (T, D)."""
    T, S = q.shape[0], k.shape[0]
    mask = None if causal else torch.ones(T, S, dtype=torch.bool)
    one = lambda x: x.double()[None, None]            # noqa: E731  (1, 1, len, D)
    return naive_attention(one(q), one(k), one(v), mask)[0, 0]


@pytest.mark.parametrize("T, S, causal", [(1, 1, True), (16, 16, True), (17, 17, True), (50, 50, True),
                                          (1, 40, False), (17, 23, False), (40, 5, False)])
@pytest.mark.parametrize("D", [16, 64])
def test_flash_one_head_matches_float64(T, S, causal, D):
    g = torch.Generator().manual_seed(T * 1000 + S * 10 + D)
    q = torch.randn(T, D, generator=g)
    k, v = (torch.randn(S, D, generator=g) for _ in range(2))
    torch.testing.assert_close(flash_attention_one_head(q, k, v, causal=causal).double(),
                               reference(q, k, v, causal), rtol=1e-5, atol=1e-5)


def test_flash_one_head_survives_large_scores():
    """Scores near 1,000: without the running max, exp would overflow."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(20, 16, generator=g) * 30
    k, v = (torch.randn(20, 16, generator=g) * 30 for _ in range(2))
    out = flash_attention_one_head(q, k, v)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T, S, D, causal, dtype", [(8, 9, 16, True, torch.float32),     # causal needs T == S
                                                    (8, 8, 24, True, torch.float32),     # not a power of two
                                                    (8, 8, 8, True, torch.float32),      # below tl.dot's 16
                                                    (8, 8, 16, True, torch.float16)])
def test_flash_one_head_refuses_what_it_does_not_handle(T, S, D, causal, dtype):
    q = torch.zeros(T, D, dtype=dtype)
    k = v = torch.zeros(S, D, dtype=dtype)
    with pytest.raises(ValueError):
        flash_attention_one_head(q, k, v, causal=causal)
