"""Notebook 08: how the budget cuts waiting prompts into chunks, step by step, and the attention mask of one chunk."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .check import Case, run_checks


def engine_chunk_plan(prompt_lens: list[int], budget: int, num_decodes: int) -> list[dict[int, int]]:
    """The engine's own scheduler, replayed without a model (course/simulate.py): `num_decodes` requests
    decoding from the first step, then these prompts, all waiting at once, with long answers. Each step:
    {prompt index: prompt tokens computed}, until every prompt is done."""
    from ..simulate import simulate

    d = num_decodes
    steps = simulate([1] * d + list(prompt_lens), [10_000] * (d + len(prompt_lens)),
                     max_num_batched_tokens=budget, max_num_seqs=d + len(prompt_lens),
                     max_steps=sum(prompt_lens) + 2)
    left, plan = list(prompt_lens), []
    for step in steps:                    # in the first step the decoders compute their one-token prompts
        chunk = {}
        for rid, n in step.tokens.items():
            i = int(rid) - d
            if i >= 0 and left[i]:
                chunk[i] = min(n, left[i])
                left[i] -= chunk[i]
        plan.append(chunk)
        if not any(left):
            return plan
    raise RuntimeError("the prompts did not finish")


def check_chunk_plan(fn) -> bool:
    """fn(prompt_lens, budget, num_decodes) -> one dict per step, {prompt index: prompt tokens computed},
    until every prompt is done; checked against the engine's scheduler."""
    cases = []
    for name, lens, budget, decodes in [
            ("one 2,000-token prompt among 16 decodes, budget 256", [2000], 256, 16),
            ("four prompts of 100, budget 64", [100] * 4, 64, 0),
            ("prompts of 300, 50 and 700 among 5 decodes, budget 64", [300, 50, 700], 64, 5),
            ("16 prompts of 100, then one of 2,000, budget 48", [100] * 16 + [2000], 48, 0),
            ("three prompts of 40 among 20 decodes, budget 24", [40, 40, 40], 24, 20)]:
        def run(fn, lens=lens, b=budget, d=decodes):
            want = engine_chunk_plan(lens, b, d)
            got = [dict(step) for step in fn(list(lens), b, d)]
            for k, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    hint = ("; a prompt whose last chunk ran in an earlier step decodes now: one token of the budget"
                            if sum(w.values()) < sum(g.values()) else "")
                    return f"step {k}: got {g}, the engine's scheduler computes {w}{hint}"
            if len(got) != len(want):
                return f"{len(got)} steps, the engine's scheduler takes {len(want)}"
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your chunk plan")


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
