"""Notebook 10: verifying drafts against a greedy target, and the distribution a rejection draws from."""
from __future__ import annotations

import random

import torch

from ...speculative.verify import verify_greedy
from .check import Case, run_checks


def check_verify_greedy(fn) -> bool:
    """fn(draft_ids, target_argmax) -> the tokens one target pass emits (accepted drafts + one more)."""
    rng = random.Random(11)
    cases = [("all drafts right: a bonus token too", [5, 6, 7], [5, 6, 7, 8]),
             ("the first draft wrong: only the correction", [5, 6, 7], [9, 6, 7, 8]),
             ("wrong in the middle", [5, 6, 7], [5, 9, 7, 8]),
             ("no drafts (k = 0)", [], [4]),
             ("a later draft that matches after a miss does not count", [1, 2, 3, 4], [1, 9, 3, 4, 5])]
    random_pairs = []
    for _ in range(200):
        k = rng.randint(0, 6)
        target = [rng.randrange(4) for _ in range(k + 1)]
        random_pairs.append(([t if rng.random() < 0.7 else rng.randrange(4) for t in target[:k]], target))
    out = []
    for name, drafts, target in cases:
        def run(fn, drafts=drafts, target=target):
            want, got = verify_greedy(drafts, target), list(fn(list(drafts), list(target)))
            return None if got == want else f"drafts {drafts}, target argmax {target}: got {got}, expected {want}"
        out.append(Case(name, run))

    def run_random(fn):
        for drafts, target in random_pairs:
            want, got = verify_greedy(drafts, target), list(fn(list(drafts), list(target)))
            if got != want:
                return f"drafts {drafts}, target argmax {target}: got {got}, expected {want}"
        return None
    out.append(Case("200 random drafts and targets", run_random))
    return run_checks(fn, out, "your verification")


def check_residual(fn) -> bool:
    """fn(p, q) -> normalize(max(0, p - q)): what a token is drawn from when a draft is rejected."""
    g = torch.Generator().manual_seed(2)
    cases = []
    examples = {"the notebook's p and q": (torch.tensor([0.10, 0.50, 0.30, 0.10]), torch.tensor([0.40, 0.40, 0.00, 0.20])),
                "a one-hot draft (an n-gram proposer): p without the guess": (torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.0, 1.0, 0.0]))}
    for i in range(3):
        p, q = (torch.rand(50, generator=g) ** 4 for _ in range(2))
        examples[f"random distributions over 50 tokens ({i + 1})"] = (p / p.sum(), q / q.sum())
    for name, (p, q) in examples.items():
        def run(fn, p=p, q=q):
            want = (p - q).clamp_min(0)
            want = want / want.sum()
            got = fn(p.clone(), q.clone())
            if not isinstance(got, torch.Tensor) or got.shape != p.shape:
                return f"expected a tensor of shape {tuple(p.shape)}"
            if abs(float(got.sum()) - 1) > 1e-5:
                return f"it sums to {float(got.sum()):.4f}; a distribution sums to 1 (normalize)"
            if (got < 0).any():
                return "it has negative entries: clamp p - q at 0 first"
            if not torch.allclose(got, want, atol=1e-6):
                return f"got {[round(x, 3) for x in got[:6].tolist()]}, expected {[round(x, 3) for x in want[:6].tolist()]}"
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your residual")
