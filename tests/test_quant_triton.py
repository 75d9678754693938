"""The Triton dequantize-and-multiply kernel (run by the interpreter here) against dequantize, then
matmul in PyTorch, on fresh random ragged shapes: rows and columns that do not fill a tile."""
import pytest
import torch
import torch.nn.functional as F

from minillm.quant import Int8Linear
from minillm.quant.linear import quantize_q4_1
from minillm.quant.triton_matmul import int8_matmul, q4_matmul

SHAPES = [(1, 40, 32), (5, 96, 96), (20, 130, 64), (70, 64, 160)]   # (M, N, K)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_kernel_equals_dequantize_then_matmul(M, N, K, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    layer = Int8Linear.from_float(torch.randn(N, K, generator=g) * 0.1)
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = F.linear(x.float(), layer.dequantize())                      # (M, N)
    y = int8_matmul(x, layer.q, layer.scale)
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 if dtype == torch.float16 else 1e-4)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_q4_kernel_equals_dequantize_then_matmul(M, N, K, dtype):
    g = torch.Generator().manual_seed(M + N * K)
    group = 64 if K % 64 == 0 else 32                                   # "q4"'s groups of 64, where K allows
    w4 = quantize_q4_1(torch.randn(N, K, generator=g) * 0.1, group)
    x = torch.randn(2, M, K, generator=g).to(dtype)                    # a leading batch dimension too
    ref = F.linear(x.float(), w4.dequantize())                          # (2, M, N)
    y = q4_matmul(x, w4.packed, *w4.per_block())                        # the kernel walks blocks of 32
    assert y.shape == (2, M, N)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=2e-2 if dtype == torch.float16 else 1e-4)


def test_k_must_be_whole_groups():
    with pytest.raises(ValueError, match="multiple"):
        int8_matmul(torch.randn(2, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))
