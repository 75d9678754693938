"""Triton in two small kernels, read before the production FlashAttention kernel (notebook 05).

    scale_rows(x, w)                       out[r, c] = x[r, c] * w[r]: program ids, tl.arange, masks, pointers
    flash_attention_one_head(q, k, v)      softmax(q kᵀ / √D) v for one head, tiles and an online softmax

A Triton kernel is the code of **one program**; a launch runs a grid of them, and each asks
`tl.program_id(axis)` which one it is. A program works on whole blocks: `tl.arange(0, BLOCK)` is a vector
of BLOCK offsets, a tensor argument arrives as a pointer to its first element, and `pointer + offsets` is a
block of addresses that `tl.load` and `tl.store` read and write in one go. Blocks have power-of-two sizes,
so the last program usually runs past the end of the data: a mask says which lanes are real.

`flash_attention_one_head` is `attention/triton_flash.py`'s `_flash_fwd_kernel` with everything but the
idea taken out: one head, one sequence (T == S when causal), float32, head dim a power of two, e^x where
the real kernel uses 2^x. On a CPU both run through Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported): slow, so keep the sizes tiny.
"""
from __future__ import annotations

import math

import torch

from ..triton_support import require_triton

require_triton("the teaching kernels of notebook 05")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scale_rows_kernel(X, W, OUT, R, C, stride_x, stride_out, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)                                        # this program: rows pid*BLOCK_R onwards
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)                  # (BLOCK_R,)
    cols = tl.arange(0, BLOCK_C)                                  # (BLOCK_C,) BLOCK_C >= C
    mask = (rows[:, None] < R) & (cols[None, :] < C)              # (BLOCK_R, BLOCK_C) lanes inside x
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)   # a tile of addresses
    w = tl.load(W + rows, mask=rows < R, other=0.0)               # (BLOCK_R,)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], x * w[:, None], mask=mask)


@triton.jit
def _flash_one_head_kernel(Q, K, V, O, T, S, scale, stride_q, stride_k, stride_v, stride_o,
                           D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program: BLOCK_M query rows against all the keys they may see, a tile of BLOCK_N at a time.
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)                      # (BLOCK_M,) this program's queries
    offs_n = tl.arange(0, BLOCK_N)                                # (BLOCK_N,) a key tile, from its start
    offs_d = tl.arange(0, D)                                      # (D,)
    q = tl.load(Q + offs_m[:, None] * stride_q + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)           # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                         # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, D], tl.float32)                      # running sum of exp(score - m_i) v
    end_n = S
    if CAUSAL:
        end_n = tl.minimum(S, start_m + BLOCK_M)                  # tiles after the last query: never visited
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n                                   # (BLOCK_N,) key positions
        k = tl.load(K + cols[:, None] * stride_k + offs_d[None, :], mask=cols[:, None] < S, other=0.0)
        v = tl.load(V + cols[:, None] * stride_v + offs_d[None, :], mask=cols[:, None] < S, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale        # (BLOCK_M, BLOCK_N)
        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                     # every row sees key 0: m_new is finite
        alpha = tl.exp(m_i - m_new)                               # (BLOCK_M,) rescales the old sums
        p = tl.exp(s - m_new[:, None])                            # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")  # (BLOCK_M, D)
        m_i = m_new
    tl.store(O + offs_m[:, None] * stride_o + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < T)


INTERPRETED = type(_scale_rows_kernel).__name__ == "InterpretedFunction"


def _check(*tensors: torch.Tensor) -> None:
    if tensors[0].device.type == "cpu" and not INTERPRETED:
        from ..attention.triton_flash import NEED_INTERPRETER

        raise RuntimeError(NEED_INTERPRETER)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the last dimension must be contiguous")


def scale_rows(x: torch.Tensor, w: torch.Tensor, block_r: int = 4) -> torch.Tensor:
    """x (R, C), w (R,) -> (R, C) with row r multiplied by w[r]. x may be a view with any row stride."""
    _check(x, w)
    R, C = x.shape
    out = torch.empty(R, C, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(R, block_r),)                             # one program per block of rows
    _scale_rows_kernel[grid](x, w, out, R, C, x.stride(0), out.stride(0),
                             BLOCK_R=block_r, BLOCK_C=triton.next_power_of_2(C))
    return out


def flash_attention_one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                             block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """q (T, D), k, v (S, D), float32, D a power of two >= 16 (tl.dot's smallest) -> (T, D).
    causal: query t sees keys 0..t (T == S, one prompt); otherwise every query sees all S keys."""
    _check(q, k, v)
    T, D = q.shape
    S = k.shape[0]
    if causal and S != T:
        raise ValueError(f"causal attention here needs as many keys as queries (got T={T}, S={S})")
    if any(t.dtype != torch.float32 for t in (q, k, v)):
        raise ValueError("float32 only (the production kernel also takes half precision)")
    if D < 16 or D & (D - 1) or S < 1:
        raise ValueError(f"head dim must be a power of two >= 16 and S >= 1 (got D={D}, S={S})")
    out = torch.empty_like(q)
    grid = (triton.cdiv(T, block_m),)                             # one program per block of queries
    _flash_one_head_kernel[grid](q, k, v, out, T, S, 1.0 / math.sqrt(D),
                                 q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                                 D=D, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
