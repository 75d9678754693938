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
            if not (torch.equal(k_cache[:, :, :start], want_k) and torch.equal(v_cache[:, :, :start], want_v)):
                return "the cache tensors themselves must hold the new keys and values: write into k_cache and " \
                       "v_cache, don't build new tensors"
            if k_all.data_ptr() != k_cache.data_ptr() or v_all.data_ptr() != v_cache.data_ptr():
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


def reference_kv_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: int, windows: list) -> int:
    """Bytes of K and V for `tokens` tokens when layer i keeps at most windows[i] of them (None: all)."""
    per_token = cfg.n_kv_heads * cfg.head_dim * 2 * bytes_per_value          # one layer's K and V, one token
    return sum(tokens if w is None else min(tokens, w) for w in windows) * per_token


def check_kv_bytes(fn) -> bool:
    """fn(cfg, tokens, bytes_per_value, windows) -> bytes of K and V, windows[i] the tokens layer i keeps."""
    smol = ModelConfig()
    gemma = ModelConfig(n_layers=62, d_model=5376, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=21504)
    oss = ModelConfig(n_layers=24, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880)
    five_to_one = [None if (i + 1) % 6 == 0 else 1024 for i in range(gemma.n_layers)]   # 5 windowed : 1 full
    alternating = [128 if i % 2 == 0 else None for i in range(oss.n_layers)]
    setups = [("SmolLM2, every layer full, 8,192 tokens, float32", smol, 8192, 4, [None] * smol.n_layers),
              ("SmolLM2, a 4,096-token window on every layer, 8,192 tokens", smol, 8192, 4, [4096] * smol.n_layers),
              ("SmolLM2, 1,024-token windows, a prompt shorter than the window", smol, 300, 4, [1024] * smol.n_layers),
              ("shaped like Gemma 3 27B: 5 layers of 1,024-token windows to 1 full, 32K tokens, bfloat16",
               gemma, 32768, 2, five_to_one),
              ("shaped like gpt-oss-20b: 128-token windows and full layers alternating, 100K tokens, bfloat16",
               oss, 100_000, 2, alternating)]
    cases = []
    for name, cfg, tokens, nbytes, windows in setups:
        def run(fn, cfg=cfg, tokens=tokens, nbytes=nbytes, windows=windows):
            got, want = fn(cfg, tokens, nbytes, windows), reference_kv_bytes(cfg, tokens, nbytes, windows)
            if got == want:
                return None
            full = reference_kv_bytes(cfg, tokens, nbytes, [None] * cfg.n_layers)
            hint = (" (K and V: times 2)" if got * 2 == want else
                    " (per KV head, not per query head)" if got == want * cfg.n_heads // cfg.n_kv_heads else
                    " (that is every layer full: a windowed layer keeps only its last tokens)" if got == full else
                    " (a windowed layer keeps min(tokens, window): never more than it was given)" if got < want else "")
            return f"got {got:,} bytes, expected {want:,}{hint}"
        cases.append(Case(name, run))
    passed = run_checks(fn, cases, "your KV size")
    if passed:
        print("\nwhat the windows keep, against every layer full:")
        for name, cfg, tokens, nbytes, windows in setups:
            kept, full = (reference_kv_bytes(cfg, tokens, nbytes, w) for w in (windows, [None] * cfg.n_layers))
            print(f"  {kept / 2**20:6,.0f} MiB of {full / 2**20:6,.0f} MiB ({kept / full:4.0%})  {name}")
    return passed
