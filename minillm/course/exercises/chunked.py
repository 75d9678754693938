"""Notebook 08: how a long prompt is cut into chunks, and the attention mask of one chunk."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .check import Case, run_checks


def check_chunk_sizes(fn) -> bool:
    """fn(prompt_len, budget, num_decodes) -> prompt tokens computed in each step until the prompt is done,
    when num_decodes running requests take one token of the budget each, first."""
    cases = []
    for prompt_len, budget, decodes in [(2000, 256, 16), (2000, 64, 16), (100, 2048, 16), (512, 256, 0), (1, 8, 3)]:
        def run(fn, p=prompt_len, b=budget, d=decodes):
            room = b - d
            want = [room] * (p // room) + ([p % room] if p % room else [])
            got = list(fn(p, b, d))
            if got != want:
                return f"prompt {p}, budget {b}, {d} decodes: got {got[:6]}{'...' if len(got) > 6 else ''} " \
                       f"({len(got)} steps), expected {want[:6]}{'...' if len(want) > 6 else ''} ({len(want)} steps)"
            return None
        cases.append(Case(f"a {prompt_len}-token prompt, budget {budget}, {decodes} decodes", run))
    return run_checks(fn, cases, "your chunking")


def check_chunk_mask(fn) -> bool:
    """fn(start, n) -> bool (n, start + n): may the chunk's query i (position start + i) see key j?"""
    cases = []
    for start, n in [(0, 4), (5, 3), (12, 1), (7, 7)]:
        def run(fn, start=start, n=n):
            want = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            got = fn(start, n)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != torch.bool:
                return f"expected a bool tensor of shape {tuple(want.shape)}, got " \
                       f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}"
            if not torch.equal(got, want):
                i, j = (got != want).nonzero()[0].tolist()
                return f"start {start}, query {i} (position {start + i}), key {j}: got {bool(got[i, j])}, " \
                       f"expected {bool(want[i, j])}"
            return None
        cases.append(Case(f"a chunk of {n} after {start} computed tokens", run))

    def same_as_whole(fn):                              # the point of the mask: chunks give the whole prompt's answer
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))    # (B, heads, T, head_dim)
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for start, n in [(0, 6), (6, 6), (12, 8)]:
            part = F.scaled_dot_product_attention(q[:, :, start:start + n], k[:, :, :start + n], v[:, :, :start + n],
                                                  attn_mask=fn(start, n))
            if not torch.allclose(part, whole[:, :, start:start + n], atol=1e-5):
                return f"the chunk {start}..{start + n - 1} with your mask differs from attention over the whole prompt"
        return None
    cases.append(Case("three chunks with your mask give attention over the whole 20-token prompt", same_as_whole))
    return run_checks(fn, cases, "your mask")
