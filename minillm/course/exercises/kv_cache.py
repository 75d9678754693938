"""Notebook 03: writing into a preallocated KV cache, and its size in bytes."""
from __future__ import annotations

import dataclasses

import torch

from ...config import ModelConfig
from ...kv import kv_cache_bytes
from .check import Case, run_checks


def reference_kv_append(k_cache, v_cache, k, v, start: int):
    """k_cache, v_cache: (B, n_kv, max_len, hd); k, v: (B, n_kv, T, hd) -> views (B, n_kv, start + T, hd)."""
    T = k.shape[2]
    k_cache[:, :, start:start + T] = k
    v_cache[:, :, start:start + T] = v
    return k_cache[:, :, :start + T], v_cache[:, :, :start + T]


def _append_case(B, n_kv, max_len, hd, steps, seed):
    def run(fn):
        g = torch.Generator().manual_seed(seed)
        k_cache, v_cache = torch.zeros(B, n_kv, max_len, hd), torch.zeros(B, n_kv, max_len, hd)
        start, seen_k, seen_v = 0, [], []
        for T in steps:
            k, v = torch.randn(B, n_kv, T, hd, generator=g), torch.randn(B, n_kv, T, hd, generator=g)
            seen_k.append(k)
            seen_v.append(v)
            out = fn(k_cache, v_cache, k, v, start)
            if not (isinstance(out, tuple) and len(out) == 2):
                return "return a pair (k_all, v_all)"
            k_all, v_all = out
            start += T
            want_k, want_v = torch.cat(seen_k, dim=2), torch.cat(seen_v, dim=2)   # (B, n_kv, start, hd)
            if k_all.shape != want_k.shape:
                return f"after writing {start} tokens: k_all has shape {tuple(k_all.shape)}, expected {tuple(want_k.shape)}"
            if not (torch.equal(k_all, want_k) and torch.equal(v_all, want_v)):
                return f"after writing {start} tokens: the returned K/V are not the tokens written, in order"
            if not torch.equal(k_cache[:, :, :start], want_k):
                return "the cache tensor itself must hold the new keys: write into k_cache, don't build a new tensor"
            if k_all.data_ptr() != k_cache.data_ptr():
                return "return a view of the cache (slicing), not a copy: copying the past each step is what the cache avoids"
        if k_cache[:, :, start:].abs().sum() != 0:
            return "slots after the last token were written"
        return None
    return Case(f"batch {B}, {n_kv} KV heads, steps of {steps} tokens", run)


def check_kv_append(fn) -> bool:
    """fn(k_cache, v_cache, k, v, start) -> (k_all, v_all)."""
    cases = [_append_case(1, 3, 16, 8, [5, 1, 1, 1], seed=0),        # a prefill, then three decode steps
             _append_case(2, 3, 32, 4, [7, 1, 4, 1], seed=1),        # a batch, and a chunk of 4
             _append_case(1, 1, 8, 2, [8], seed=2)]                  # exactly full
    return run_checks(fn, cases, "your KV append")


def check_kv_bytes(fn) -> bool:
    """fn(cfg, tokens, bytes_per_value) -> bytes of K and V for `tokens` tokens."""
    smol = ModelConfig()
    llama8b = ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336)
    mha = dataclasses.replace(smol, n_kv_heads=smol.n_heads)
    cases = []
    for name, cfg, tokens, nbytes, dtype in [("SmolLM2, 1 token, float32", smol, 1, 4, torch.float32),
                                             ("SmolLM2, 8,192 tokens, float32", smol, 8192, 4, torch.float32),
                                             ("SmolLM2 with 9 KV heads (MHA), 100 tokens", mha, 100, 4, torch.float32),
                                             ("an 8B Llama, 4,096 tokens, bfloat16", llama8b, 4096, 2, torch.bfloat16)]:
        def run(fn, cfg=cfg, tokens=tokens, nbytes=nbytes, dtype=dtype):
            got, want = fn(cfg, tokens, nbytes), kv_cache_bytes(cfg, tokens, dtype)
            if got == want:
                return None
            hint = " (K and V: times 2)" if got * 2 == want else " (per KV head, not per query head)" if got == want * cfg.n_heads // cfg.n_kv_heads else ""
            return f"got {got:,} bytes, expected {want:,}{hint}"
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your KV size formula")
