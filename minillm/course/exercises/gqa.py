"""Notebook 04: decode attention for grouped-query attention, without copying K/V."""
from __future__ import annotations

import torch

from ...attention import gqa_attention, naive_attention, sdpa_attention
from .check import Case, TorchCalls, run_checks


def _qkv(B, H, n_kv, T, S, hd, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, n_kv, S, hd, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def check_gqa_decode(fn) -> bool:
    """fn(q (B, H, 1, hd), k, v (B, n_kv, S, hd)) -> (B, H, 1, hd), equal to naive attention, copying no K/V."""
    cases = []
    for B, H, n_kv, S, hd in [(1, 9, 3, 17, 64), (2, 8, 2, 5, 16), (1, 4, 4, 9, 8), (3, 6, 1, 33, 32)]:
        def run(fn, B=B, H=H, n_kv=n_kv, S=S, hd=hd):
            q, k, v = _qkv(B, H, n_kv, 1, S, hd, seed=S)
            with TorchCalls() as calls:
                got = fn(q, k, v)
            want = naive_attention(q, k, v)
            if getattr(got, "shape", None) != want.shape:
                return f"shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
            if copies := sorted(calls.names & {"repeat", "repeat_interleave", "expand", "tile", "cat", "stack"}):
                return f"it calls {', '.join(copies)}: K and V must be read where they are, not copied per query head"
            if calls.names & {"scaled_dot_product_attention"} or fn in (gqa_attention, sdpa_attention):
                return "it calls a finished attention (SDPA or minillm's own): write the products and the softmax"
            err = (got - want).abs().max().item()
            if err < 1e-10:
                return None
            tiled = naive_attention(q, k.repeat(1, H // n_kv, 1, 1), v.repeat(1, H // n_kv, 1, 1))
            if n_kv > 1 and H > n_kv and (got - tiled).abs().max() < 1e-10:
                return ("query head h must read KV head h // group (heads 0, 1, 2 share KV head 0): "
                        "the group's heads are neighbours in q, so view q as (B, n_kv, group, hd)")
            return f"differs from naive attention by up to {err:.2g} (float64)"
        cases.append(Case(f"{H} query heads over {n_kv} KV head{'s' * (n_kv > 1)}, {S} keys, batch {B}", run))
    return run_checks(fn, cases, "your GQA decode attention")
