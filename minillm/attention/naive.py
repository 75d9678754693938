"""Stage 1 attention: materialize the whole score matrix.

    scores = q @ k^T / sqrt(head_dim)      (B, n_heads, T, S)  <- T*S floats per head
    scores[masked] = -inf                  causal: a query sees only keys at or before its position
    out = softmax(scores) @ v              (B, n_heads, T, head_dim)

Grouped-query attention the readable way: each KV head is repeated for the
query heads that share it (`repeat_interleave`), so the math is plain MHA.
Later stages compute the same thing without the copies or the T x S matrix.
"""
from __future__ import annotations

import math

import torch


def causal_mask(T: int, S: int, device=None) -> torch.Tensor:
    """(T, S) bool, True where query t may attend key s.

    Queries are the *last* T positions of the S keys (bottom-right alignment), so
    T == S is the usual lower triangle and T == 1 (decode) sees every key.
    """
    q_pos = torch.arange(S - T, S, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=device)[None, :]         # (1, S)
    return k_pos <= q_pos


def mask_from_positions(positions: torch.Tensor, S: int) -> torch.Tensor:
    """(B, 1, T, S) bool from per-sequence query positions (B, T): key slot s is
    visible to a query at position p when s <= p. Slots hold positions in order, so
    this is causal masking and hides each sequence's unused (padding) slots."""
    k_pos = torch.arange(S, device=positions.device)        # (S,)
    return k_pos[None, None, None, :] <= positions[:, None, :, None]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, n_heads, T, hd); k, v: (B, n_kv_heads, S, hd) -> (B, n_heads, T, hd).

    mask: bool, broadcastable to (B, n_heads, T, S), True = may attend; None = causal.
    """
    B, H, T, hd = q.shape
    S, n_kv = k.shape[2], k.shape[1]
    k = k.repeat_interleave(H // n_kv, dim=1)                  # (B, H, S, hd)
    v = v.repeat_interleave(H // n_kv, dim=1)                  # (B, H, S, hd)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)         # (B, H, T, S)
    if mask is None:
        mask = causal_mask(T, S, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)                      # (B, H, T, S)
    return probs @ v                                           # (B, H, T, hd)
