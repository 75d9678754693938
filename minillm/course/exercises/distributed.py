"""Notebook 13: a rank's rows of the fused QKV weight, and the bytes a disaggregated hand-over moves."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ...distributed.disaggregated import transfer_bytes
from ...distributed.tensor_parallel import qkv_rows
from .check import Case, run_checks


def check_qkv_shard(fn) -> bool:
    """fn(wqkv ((H + 2 n_kv) hd, d), n_heads, n_kv_heads, head_dim, rank, world) -> the rows rank keeps."""
    g = torch.Generator().manual_seed(13)
    cases = []
    for H, n_kv, hd, rank, world in [(9, 3, 4, 0, 3), (9, 3, 4, 2, 3), (8, 4, 2, 1, 2), (8, 2, 3, 1, 2), (4, 2, 2, 0, 1)]:
        cfg = SimpleNamespace(n_heads=H, n_kv_heads=n_kv, head_dim=hd)
        w = torch.randn((H + 2 * n_kv) * hd, 6, generator=g)

        def run(fn, w=w, cfg=cfg, rank=rank, world=world):
            want = w[qkv_rows(cfg, rank, world)]
            got = fn(w.clone(), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rank, world)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"expected {tuple(want.shape)} ({cfg.n_heads // world} query heads and " \
                       f"{cfg.n_kv_heads // world} K and V heads of {cfg.head_dim} rows), got {tuple(getattr(got, 'shape', ()))}"
            if torch.equal(got, want):
                return None
            n = len(want)
            if torch.equal(got, w[rank * n:(rank + 1) * n]):
                return "a contiguous slice mixes heads of different kinds: the fused weight is q heads | k heads | " \
                       "v heads, and a rank takes its part of each"
            first = next(i for i in range(n) if not torch.equal(got[i], want[i]))
            return f"row {first} of your shard is not the right row (q rows first, then k, then v)"
        cases.append(Case(f"{H} query heads, {n_kv} KV heads, rank {rank} of {world}", run))
    return run_checks(fn, cases, "your QKV shard")


def check_transfer_bytes(fn) -> bool:
    """fn(prompt_len, block_size, n_layers, n_kv_heads, head_dim, dtype_bytes) -> bytes the prefill worker sends."""
    smol = dict(n_layers=30, n_kv_heads=3, head_dim=64)
    cases = []
    for n, bs, dtype_bytes, shape in [(100, 16, 4, smol), (17, 16, 4, smol), (16, 16, 4, smol), (1000, 16, 2, smol),
                                      (50, 8, 4, dict(n_layers=2, n_kv_heads=1, head_dim=8))]:
        cfg = SimpleNamespace(**shape)

        def run(fn, n=n, bs=bs, dtype_bytes=dtype_bytes, cfg=cfg):
            want = transfer_bytes(cfg, n, bs, dtype_bytes)
            got = fn(n, bs, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype_bytes)
            if got == want:
                return None
            per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
            if got == per_token * n or got == per_token * -(-n // bs) * bs:
                return f"got {got:,}: only full blocks travel, and not the one holding the last prompt token " \
                       f"(the decode worker computes that token itself); expected {want:,}"
            if got * 2 == want:
                return f"got {got:,}, half of {want:,}: both K and V travel"
            return f"got {got:,}, expected {want:,}"
        cases.append(Case(f"a {n}-token prompt, blocks of {bs}, {dtype_bytes}-byte values", run))
    return run_checks(fn, cases, "your transfer size")
