"""PyTorch's fused attention (`F.scaled_dot_product_attention`) behind the course's interface.

One call instead of five (matmul, scale, mask, softmax, matmul), a fused kernel on CPU and GPU,
and grouped-query attention without copying K/V (`enable_gqa=True`).

Causal alignment: our convention (and flash-attn's) is bottom-right: the T queries are the
*last* T positions of the S keys. SDPA's `is_causal=True` is top-left, which only agrees
when T == S, so other shapes get an explicit mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import causal_mask


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, n_heads, T, hd); k, v: (B, n_kv_heads, S, hd) -> (B, n_heads, T, hd)."""
    T, S = q.shape[2], k.shape[2]
    if mask is None:
        if T == 1:    # one query at the last position sees every key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if T == S:    # the plain lower triangle
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = causal_mask(T, S, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
