"""Attention functions. Each takes q (B, n_heads, T, hd), k and v (B, n_kv_heads, S, hd) and an
optional bool mask (True = may attend; None = causal, bottom-right aligned), and returns
(B, n_heads, T, hd). The model does not care which one it is given."""
from .gqa import gqa_attention
from .naive import causal_mask, mask_from_positions, naive_attention
from .sdpa import sdpa_attention

ATTENTION = {"naive": naive_attention, "gqa": gqa_attention, "sdpa": sdpa_attention}

__all__ = ["ATTENTION", "causal_mask", "gqa_attention", "mask_from_positions", "naive_attention", "sdpa_attention"]
