"""Tiled attention with an online softmax, in plain PyTorch: FlashAttention's math, readable.

Naive attention builds the whole (T, S) score matrix, then softmaxes each row. Here
each block of BLOCK_M queries walks over the keys in blocks of BLOCK_N and keeps, per
query row, three running quantities:

    m    the largest score seen so far
    l    sum of exp(score - m) over the keys seen so far
    acc  sum of exp(score - m) * v over the keys seen so far

When a new block raises the max from m to m', everything accumulated so far is
rescaled by exp(m - m'), so at the end acc / l is exactly softmax(scores) @ v.
Only a (BLOCK_M, BLOCK_N) tile of scores exists at any time: memory O(T + S)
instead of O(T x S). With causal masking, key blocks wholly after the last query
of a block are never visited (about half the work).
"""
from __future__ import annotations

import math

import torch


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q: (B, n_heads, T, hd); k, v: (B, n_kv_heads, S, hd) -> (B, n_heads, T, hd). Causal,
    bottom-right aligned (query t sits at key position t + S - T); `mask` is not supported."""
    if mask is not None:
        raise ValueError("tiled_attention is causal only; pass mask=None")
    B, H, T, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    g = H // n_kv
    q = q.reshape(B, n_kv, g, T, hd)                                    # GQA: group heads share K/V
    out = torch.empty_like(q)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)             # accumulate in float32 at least
    scale = 1.0 / math.sqrt(hd)
    offset = S - T                                                      # bottom-right causal alignment
    for i in range(0, T, block_m):
        qi = q[:, :, :, i:i + block_m] * scale                          # (B, n_kv, g, bm, hd)
        rows = torch.arange(i, min(i + block_m, T), device=q.device) + offset
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (B, n_kv, g, bm)
        l = torch.zeros(qi.shape[:-1], dtype=acc_dtype, device=q.device)
        acc = torch.zeros(qi.shape, dtype=acc_dtype, device=q.device)
        last_key = min(S, int(rows[-1]) + 1)                            # later key blocks are all masked
        for j in range(0, last_key, block_n):
            kj = k[:, :, None, j:j + block_n]                           # (B, n_kv, 1, bn, hd)
            vj = v[:, :, None, j:j + block_n]
            s = (qi @ kj.transpose(-2, -1)).to(acc_dtype)               # (B, n_kv, g, bm, bn): one tile
            cols = torch.arange(j, j + kj.shape[3], device=q.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)    # a row with no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)                               # rescale the old sums
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ vj.to(acc_dtype)
            m = m_new
        out[:, :, :, i:i + block_m] = torch.where(l[..., None] > 0, acc / l[..., None], 0.0).to(q.dtype)
    return out.reshape(B, H, T, hd)
