"""Counting bytes and FLOPs of a forward pass, and measuring what this machine can move and compute.

A decode step for a batch of B sequences with S cached tokens must
    read every weight once                      weight_bytes
    read each sequence's K/V cache              B x kv_cache_bytes(S)
    do ~2 FLOPs per weight per token            2 x params x B   (+ attention: 4 x S x layers x heads x hd x B)
The step can be no faster than bytes / bandwidth (memory floor) nor FLOPs / peak (compute floor).
At B = 1 the memory floor is far higher: decode is memory-bound.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .kv import kv_cache_bytes
from .metrics import median_time


def weight_bytes(model) -> int:
    """Bytes of every parameter and buffer the model holds (quantized codes and scales included),
    each tensor counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def forward_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step must read: the weights once plus every sequence's K/V cache."""
    return weight_bytes(model) + batch * kv_cache_bytes(model.cfg, context, model.dtype, getattr(model, "kv_cache_dtype", None))


def forward_flops(cfg: ModelConfig, n_params: int, tokens: int, context: int) -> int:
    """FLOPs of a forward over `tokens` new tokens that each attend over `context` keys:
    2 per weight per token (a multiply and an add), plus QK^T and PV in attention."""
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return tokens * (2 * n_params + attention)


def measure_copy_bandwidth(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy, counting bytes read + written."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), repeats=repeats)
    return 2 * n_bytes / t


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """FLOP/s of a square matrix multiply (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = median_time(lambda: a @ b, repeats=repeats)
    return 2 * n**3 / t
