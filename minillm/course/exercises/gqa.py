"""Notebook 04: which KV head a query head reads, and decode attention without copying K/V."""
from __future__ import annotations

import torch

from ...attention import naive_attention
from .check import Case, run_checks


def _qkv(B, H, n_kv, T, S, hd, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, n_kv, S, hd, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def check_repeat_kv(fn) -> bool:
    """fn(k (B, n_kv, S, hd), group) -> (B, n_kv * group, S, hd): query head h reads KV head h // group."""
    cases = []
    for B, n_kv, group in [(1, 3, 3), (2, 2, 4), (1, 1, 9), (1, 4, 1)]:
        def run(fn, B=B, n_kv=n_kv, group=group):
            k = torch.arange(B * n_kv * 5 * 2, dtype=torch.float32).view(B, n_kv, 5, 2)   # (B, n_kv, S, hd)
            got = fn(k, group)
            want = k.repeat_interleave(group, dim=1)
            if getattr(got, "shape", None) != want.shape:
                return f"shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
            if torch.equal(got, want):
                return None
            if n_kv > 1 and group > 1 and torch.equal(got, k.repeat(1, group, 1, 1)):
                return ("the heads are tiled (0, 1, 2, 0, 1, 2, ...); query head h must read KV head h // group "
                        "(0, 0, 0, 1, 1, 1, ...): repeat_interleave, not repeat")
            return "some query head reads the wrong KV head"
        cases.append(Case(f"{n_kv} KV head{'s' * (n_kv > 1)}, groups of {group}, batch {B}", run))
    return run_checks(fn, cases, "your repeat_kv")


def check_gqa_decode(fn) -> bool:
    """fn(q (B, H, 1, hd), k, v (B, n_kv, S, hd)) -> (B, H, 1, hd), equal to naive attention, copying no K/V."""
    cases = []
    for B, H, n_kv, S, hd in [(1, 9, 3, 17, 64), (2, 8, 2, 5, 16), (1, 4, 4, 9, 8), (3, 6, 1, 33, 32)]:
        def run(fn, B=B, H=H, n_kv=n_kv, S=S, hd=hd):
            q, k, v = _qkv(B, H, n_kv, 1, S, hd, seed=S)
            got = fn(q, k, v)
            want = naive_attention(q, k, v)
            if getattr(got, "shape", None) != want.shape:
                return f"shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
            err = (got - want).abs().max().item()
            return None if err < 1e-10 else f"differs from naive attention by up to {err:.2g} (float64)"
        cases.append(Case(f"{H} query heads over {n_kv} KV head{'s' * (n_kv > 1)}, {S} keys, batch {B}", run))
    return run_checks(fn, cases, "your GQA decode attention")
