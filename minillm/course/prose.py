"""Comparison words computed from measured numbers, so a notebook's conclusions are printed by the cell
that measured them and hold on every rerun (a typed "2× faster" drifts from the outputs at the next one)."""
from __future__ import annotations


def versus(a: float, b: float, within: float = 0.05) -> str:
    """How a compares with b, as words that read before b: '2.1× higher than', '1.3× lower than', or
    'within 5% of' when they differ by less than `within`."""
    if a <= 0 or b <= 0:
        raise ValueError(f"versus compares positive measurements, got {a} and {b}")
    if abs(a / b - 1) <= within:
        return f"within {within:.0%} of"
    return f"{a / b:.1f}× higher than" if a > b else f"{b / a:.1f}× lower than"
