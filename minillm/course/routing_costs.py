"""Routing measured offline (notebook 10, benchmarks/routing.py): how well a confidence signal separates the
cheap model's agreeing answers from the rest (`auc`), and what each threshold would cost and keep
(`tradeoff`). The router itself is `minillm/routing.py`."""
from __future__ import annotations

import math


def auc(scores: list[float], labels: list[bool]) -> float:
    """The chance that a random agreeing answer (label True) scores above a random disagreeing one (ties
    count half): 0.5 is a coin, 1.0 a perfect signal. nan when one class is empty."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def tradeoff(rows: list[dict], signal: str, cheap_key: str = "cheap_s", exact_key: str = "exact_s") -> list[dict]:
    """rows: per prompt, {signal: confidence, "agrees": the cheap answer equals the exact one, cheap_key:
    the cheap answer's cost, exact_key: the exact answer's}. For each threshold (below every confidence,
    at each one, above all): share escalated, cost relative to sending everything to the exact model, and
    agreement (an escalated request gets the exact answer, so it agrees)."""
    total_exact = sum(r[exact_key] for r in rows)
    points = []
    for t in [-math.inf, *sorted({r[signal] for r in rows}), math.inf]:
        up = [r[signal] < t for r in rows]
        cost = sum(r[cheap_key] + (r[exact_key] if u else 0.0) for r, u in zip(rows, up))
        points.append({"threshold": t if math.isfinite(t) else None, "escalated": sum(up) / len(rows),
                       "relative_cost": cost / total_exact,
                       "agreement": sum(u or r["agrees"] for r, u in zip(rows, up)) / len(rows)})
    return points
