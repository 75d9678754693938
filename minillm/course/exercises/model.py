"""Notebook 01: RMSNorm and causal attention for one head, checked against the model's own."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .check import Case, run_checks


def _close(got, want, what: str) -> str | None:
    if getattr(got, "shape", None) != want.shape:
        return f"{what}: shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().max().item()
    return None if err < 1e-5 else f"{what}: differs by up to {err:.3g}"


def check_rms_norm(fn) -> bool:
    """fn(x (..., d), weight (d,), eps) -> x / sqrt(mean(x^2) + eps) * weight."""
    cases = []
    for shape, eps, scale in [((1, 5, 576), 1e-5, 1.0), ((2, 3, 8), 1e-5, 10.0), ((4, 16), 0.5, 0.01)]:
        def run(fn, shape=shape, eps=eps, scale=scale):
            g = torch.Generator().manual_seed(len(shape) + shape[-1])
            x = torch.randn(*shape, generator=g) * scale
            w = torch.rand(shape[-1], generator=g) + 0.5
            got, want = fn(x, w, eps), F.rms_norm(x, (shape[-1],), w, eps)
            problem = _close(got, want, "output")
            if problem and isinstance(got, torch.Tensor) and got.shape == want.shape:
                if _close(got, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps), "") is None:
                    problem += " (multiply by weight at the end)"
                elif _close(got, x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w, "") is None:
                    problem += " (the mean of x², not the sum)"
                elif _close(got, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True)) * w, "") is None:
                    problem += " (add eps inside the square root)"
            return problem
        cases.append(Case(f"x of shape {shape}, eps {eps}, values of size ~{scale}", run))
    return run_checks(fn, cases, "your RMSNorm")


def reference_causal_attention(q, k, v):
    T, hd = q.shape
    scores = q @ k.T / math.sqrt(hd)                                   # (T, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()                   # query t sees keys 0..t
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v   # (T, hd)


def check_causal_attention(fn) -> bool:
    """fn(q, k, v), each (T, head_dim), one head -> (T, head_dim) = softmax(q k^T / sqrt(hd), causal) v."""
    cases = []
    for T, hd in [(1, 4), (5, 8), (12, 64)]:
        def run(fn, T=T, hd=hd):
            g = torch.Generator().manual_seed(T)
            q, k, v = (torch.randn(T, hd, generator=g, dtype=torch.float64) for _ in range(3))
            got, want = fn(q, k, v), reference_causal_attention(q, k, v)
            problem = _close(got, want, "output")
            if problem and T > 1 and isinstance(got, torch.Tensor) and got.shape == want.shape:
                if _close(got, torch.softmax(q @ k.T / math.sqrt(hd), -1) @ v, "") is None:
                    problem += " (no causal mask: query t must not see keys after t)"
                elif _close(got, torch.softmax((q @ k.T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                               float("-inf")), -1) @ v, "") is None:
                    problem += " (divide the scores by sqrt(head_dim))"
            return problem
        cases.append(Case(f"{T} token{'s' * (T > 1)}, head dim {hd}", run))
    return run_checks(fn, cases, "your causal attention")
