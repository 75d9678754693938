"""Notebook 14: RoPE on neighbouring pairs without chunk or cat, and splitting a step's profile four ways."""
from __future__ import annotations

import torch

from .check import Case, TorchCalls, run_checks


def interleaved_tables(hd: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, hd) for RoPE on neighbouring pairs (2i, 2i + 1), as Meta's original Llama code and GPT-J
    pair them: each pair's angle twice, and sin's even entries negated (the minus sign of the rotation)."""
    inv_freq = base ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)        # (hd/2,)
    angles = positions.float()[:, None] * inv_freq[None, :]                       # (T, hd/2)
    cos = angles.cos().repeat_interleave(2, dim=-1)                               # (T, hd): c0 c0 c1 c1 ...
    sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)          # (T, hd): -s0 s0 -s1 s1 ...
    return cos, sin


def reference_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The complex form of Meta's code: each neighbouring pair is one complex number, multiplied by e^(i angle)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())     # (B, heads, T, hd/2)
    turn = torch.complex(cos[..., ::2], sin[..., 1::2])                               # (T, hd/2)
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


_FORBIDDEN = {"cat", "concat", "concatenate", "chunk", "stack", "split", "tensor_split", "unbind", "view_as_complex"}


def check_rope_interleaved(fn) -> bool:
    """fn(x (B, heads, T, hd), cos, sin (T, hd) from interleaved_tables) -> x with each neighbouring pair
    (2i, 2i + 1) rotated, in x's dtype, without cat, chunk, stack or split."""
    g = torch.Generator().manual_seed(14)
    cases = []
    for name, shape, dtype in [("one decode token, float32", (1, 12, 1, 64), torch.float32),
                               ("a 7-token prompt, 15 heads", (2, 15, 7, 64), torch.float32),
                               ("bfloat16 activations", (1, 3, 5, 64), torch.bfloat16),
                               ("a head of 16", (1, 2, 3, 16), torch.float32)]:
        x = torch.randn(shape, generator=g).to(dtype)
        positions = torch.randint(0, 8192, (shape[2],), generator=g)
        cos, sin = interleaved_tables(shape[-1], positions, 100000.0)

        def run(fn, x=x, cos=cos, sin=sin):
            want = reference_rope_interleaved(x, cos, sin)
            calls = TorchCalls()
            with calls:
                got = fn(x.clone(), cos.clone(), sin.clone())
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"expected shape {tuple(want.shape)}, got {tuple(getattr(got, 'shape', ()))}"
            if got.dtype != x.dtype:
                return f"return x's dtype ({x.dtype}), got {got.dtype}"
            used = sorted(calls.names & _FORBIDDEN)
            if used:
                return f"it calls {', '.join(used)}: rotate the pairs without taking the tensor apart and gluing it"
            tol = 1e-5 if x.dtype == torch.float32 else 2e-2
            err = (got.float() - want.float()).abs()
            if err.max() > tol * (1 + want.float().abs().max()):
                i = err.flatten().argmax().item()
                j = i % x.shape[-1]
                return (f"coordinate {j} of a head is {got.flatten()[i].item():+.5f}, expected "
                        f"{want.flatten()[i].item():+.5f}: coordinate {j} pairs with {j ^ 1} (its neighbour), "
                        "and sin's even entries already carry the minus sign")
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your RoPE")


# (operator, the operators it runs inside, outermost last, self milliseconds)
_EVENTS = [
    ("aten::mm", ("aten::linear",), 30.0),
    ("aten::_weight_int4pack_mm_for_cpu", (), 6.0),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ("aten::scaled_dot_product_attention",), 2.0),
    ("aten::scaled_dot_product_attention", (), 0.5),
    ("aten::copy_", ("aten::to",), 1.5),
    ("aten::copy_", ("aten::_to_copy", "aten::contiguous", "aten::scaled_dot_product_attention"), 0.25),
    ("aten::index_select", (), 3.0),
    ("aten::index_select", ("aten::embedding",), 0.1),
    ("aten::rms_norm", (), 1.0),
    ("aten::add", (), 0.75),
]


def _reference_split(events, wall_ms):
    from ..step_profile import _category

    class E:                                    # the profiler's event: a name and a parent
        def __init__(self, name, parents):
            self.name = name
            self.cpu_parent = E(parents[0], parents[1:]) if parents else None
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, parents, ms in events:
        parts[_category(E(name, parents))] += ms
    return parts | {"python": wall_ms - sum(parts.values())}


def check_step_split(fn) -> bool:
    """fn(events [(name, parents, self_ms)], wall_ms) -> {"matmul", "attention", "other", "python": ms}."""
    cases = []
    for name, events, wall in [("a float32 step: one matrix product, one norm", [_EVENTS[0], _EVENTS[8]], 40.0),
                               ("attention and the operators inside it", _EVENTS[2:4] + _EVENTS[5:6], 4.0),
                               ("a page gather, and the embedding's lookup", _EVENTS[6:8], 5.0),
                               ("a whole 4-bit step", _EVENTS, 60.0)]:
        def run(fn, events=events, wall=wall):
            want = _reference_split(events, wall)
            got = fn(list(events), wall)
            if not isinstance(got, dict) or set(got) != set(want):
                return f"return a dict with keys {sorted(want)}, got {sorted(got) if isinstance(got, dict) else got}"
            wrong = [k for k in want if abs(got[k] - want[k]) > 1e-9]
            if wrong:
                return "; ".join(f"{k} {got[k]:g} ms, expected {want[k]:g}" for k in wrong)
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your four-way split")
