"""Attention functions. Each takes q (B, n_heads, T, hd), k and v (B, n_kv_heads, S, hd) and an
optional bool mask (True = may attend; None = causal, bottom-right aligned), and returns
(B, n_heads, T, hd). The model does not care which one it is given.

The Triton kernels (`flash_attn_varlen`, `decode_attention`) use flash-attn's packed layouts
instead; they load on first use, because triton must see TRITON_INTERPRET=1 (on a CPU) before
it is imported.
"""
from .gqa import gqa_attention
from .naive import causal_mask, mask_from_positions, naive_attention
from .sdpa import sdpa_attention
from .tiled import tiled_attention

__all__ = ["causal_mask", "decode_attention", "flash_attn_varlen", "gqa_attention",
           "mask_from_positions", "naive_attention", "sdpa_attention", "tiled_attention"]


def __getattr__(name):
    if name in ("flash_attn_varlen", "decode_attention"):
        from . import triton_flash

        return getattr(triton_flash, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
