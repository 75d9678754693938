"""Grouped-query attention without copying K/V.

SmolLM2 has 9 query heads and 3 KV heads: query heads 0-2 read KV head 0, 3-5 read
KV head 1, 6-8 read KV head 2. `naive_attention` repeats each KV head 3 times
(`repeat_interleave`) so the math is plain multi-head attention; that copies K and
V, 2 x S x head_dim floats per extra head, every layer, every step.

Here the query heads of a group are folded into the rows instead:

    q (B, H, T, hd) -> (B, n_kv, group * T, hd)     a view: heads of a group are adjacent
    scores = q @ k^T -> (B, n_kv, group * T, S)     each KV head is read once

Same numbers, no repeated K/V.
"""
from __future__ import annotations

import math

import torch

from .naive import causal_mask


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, n_heads, T, hd); k, v: (B, n_kv_heads, S, hd) -> (B, n_heads, T, hd)."""
    B, H, T, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    g = H // n_kv
    qg = q.reshape(B, n_kv, g * T, hd)                                   # (B, n_kv, g*T, hd)
    scores = (qg @ k.transpose(-2, -1)) / math.sqrt(hd)                  # (B, n_kv, g*T, S)
    scores = scores.view(B, n_kv, g, T, S)                               # (B, n_kv, g, T, S)
    if mask is None:
        mask = causal_mask(T, S, q.device)                               # (T, S)
    elif mask.dim() == 4:
        mask = mask[:, :, None]                                          # (B, 1, 1, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, n_kv, g * T, S)
    return (probs @ v).view(B, H, T, hd)                                 # (B, H, T, hd)
