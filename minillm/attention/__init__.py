"""Attention functions. Each takes q (B, n_heads, T, hd), k and v (B, n_kv_heads, S, hd)
and returns (B, n_heads, T, hd); the model does not care which one it is given."""
from .naive import causal_mask, naive_attention

__all__ = ["causal_mask", "naive_attention"]
