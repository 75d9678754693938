"""Dequantize-and-multiply on a GPU, in Triton: y = x @ W^T with W stored in 8 or 4 bits.

Decode is memory-bound: a step reads every weight once and does two flops with each. So the kernel
reads the *quantized* weight tile from memory, dequantizes it in registers, and multiplies it there
(tensor cores, float32 accumulation); the float weight never exists in memory. One program computes
a BLOCK_M x BLOCK_N tile of y, walking K in steps of 32 (one 4-bit group):

    int8   W tile (BLOCK_N, 32) int8 -> x dtype; after the loop, column n of y times scale[n]
    q4     llama.cpp's Q4_1 group: 16 bytes per row, the low nibble of byte j is weight j and the high
           nibble weight j + 16, so the group splits into two halves of 16 weights, each w = q * d + m,
           multiplied by the matching 16 columns of x

On the CPU the same layers call PyTorch's CPU kernels (`linear.py`); the interpreter
(TRITON_INTERPRET=1) runs this one there for the tests.
"""
from __future__ import annotations

import torch

from ..triton_support import require_triton

require_triton("the GPU dequantize-and-multiply kernel")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

GROUP = 32


@triton.jit(do_not_specialize=["M", "sx_m", "sy_m"])
def _dequant_matmul_kernel(X, W, S, Mn, Y, M, N, K, sx_m, sw_n, ss_n, sy_m,
                           Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # rows of W, columns of y
    m_ok, n_ok = rm < M, rn < N
    half = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // 32):
        if Q4:
            b = tl.load(W + rn[:, None] * sw_n + g * 16 + half[None, :], mask=n_ok[:, None], other=0)  # (BN, 16) u8
            d = tl.load(S + rn * ss_n + g, mask=n_ok, other=0.0).to(tl.float32)                      # (BN,)
            mn = tl.load(Mn + rn * ss_n + g, mask=n_ok, other=0.0).to(tl.float32)
            w_lo = ((b & 0x0F).to(tl.float32) * d[:, None] + mn[:, None]).to(X.dtype.element_ty)   # weights 0..15
            w_hi = ((b >> 4).to(tl.float32) * d[:, None] + mn[:, None]).to(X.dtype.element_ty)    # weights 16..31
            x_lo = tl.load(X + rm[:, None] * sx_m + g * 32 + half[None, :], mask=m_ok[:, None], other=0.0)
            x_hi = tl.load(X + rm[:, None] * sx_m + g * 32 + 16 + half[None, :], mask=m_ok[:, None], other=0.0)
            acc += tl.dot(x_lo, tl.trans(w_lo)) + tl.dot(x_hi, tl.trans(w_hi))
        else:
            k = g * 32 + tl.arange(0, 32)
            w = tl.load(W + rn[:, None] * sw_n + k[None, :], mask=n_ok[:, None], other=0)           # (BN, 32) i8
            x = tl.load(X + rm[:, None] * sx_m + k[None, :], mask=m_ok[:, None], other=0.0)         # (BM, 32)
            acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)))
    if not Q4:
        acc = acc * tl.load(S + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]   # per-row scale of W
    tl.store(Y + rm[:, None] * sy_m + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x, w, s, mn, n_out, q4):
    if x.shape[-1] % GROUP:
        raise ValueError(f"the kernel walks K in steps of {GROUP}; K = {x.shape[-1]} is not a multiple")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                                  # (M, K)
    M, K = x2.shape
    y = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(n_out, 64))
    _dequant_matmul_kernel[grid](x2, w, s, mn, y, M, n_out, K, x2.stride(0), w.stride(0), s.stride(0), y.stride(0),
                                 Q4=q4, BLOCK_M=block_m, BLOCK_N=64)
    return y.view(*x.shape[:-1], n_out)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float16 | bfloat16 | float32; q (N, K) int8; scale (N,) -> (..., N) = x @ (q * scale)^T."""
    return _launch(x, q.contiguous(), scale.float().contiguous(), scale, q.shape[0], q4=False)


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x (..., K); packed (N, K/2) uint8 (Q4_1 order); d, m (N, K/32) -> (..., N) = x @ W^T, W = q d + m."""
    return _launch(x, packed.contiguous(), d.contiguous(), m.contiguous(), packed.shape[0], q4=True)
