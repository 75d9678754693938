"""Notebook 05: the online-softmax step, and merging the key slices of flash-decoding."""
from __future__ import annotations

import torch

from .check import Case, run_checks


def check_online_softmax(fn) -> bool:
    """fn(m, l, acc, s (n,), v (n, D)) -> (m, l, acc) after one more chunk of keys."""
    cases = []
    for n_keys, D, chunks, spread, seed in [(10, 4, [4, 4, 2], 3.0, 0), (33, 8, [1] * 33, 1.0, 1),
                                            (50, 16, [7, 20, 23], 1000.0, 2), (12, 4, [3, 9], 3.0, 3)]:
        def run(fn, n_keys=n_keys, D=D, chunks=chunks, spread=spread, seed=seed):
            g = torch.Generator().manual_seed(seed)
            s = torch.randn(n_keys, generator=g, dtype=torch.float64) * spread      # (n,) one row of scores
            v = torch.randn(n_keys, D, generator=g, dtype=torch.float64)            # (n, D)
            if seed == 3:
                s[:3] = float("-inf")                                               # a first chunk fully masked
            m, l, acc = torch.tensor(float("-inf"), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), \
                torch.zeros(D, dtype=torch.float64)
            start = 0
            for n in chunks:
                m, l, acc = fn(m, l, acc, s[start:start + n], v[start:start + n])
                start += n
            want = torch.softmax(s, 0) @ v
            got = acc / l
            if not torch.isfinite(got).all():
                if spread > 10:
                    return "nan or inf: exp of scores ~1000 overflows; subtract the running max before exp"
                return "the result has nan or inf: a chunk of only -inf scores must leave the state as it was"
            if float(m) != float(s.max()):
                return f"the running max is {float(m):.4g} after the last chunk, expected {float(s.max()):.4g}"
            err = (got - want).abs().max().item()
            if err < 1e-10:
                return None
            if spread > 10:
                return f"differs from softmax by {err:.2g}: with large scores, subtract the running max before exp"
            return f"acc / l differs from softmax(s) @ v by up to {err:.2g}: rescale l and acc by exp(m_old - m_new)"
        what = "a first chunk of -inf scores" if seed == 3 else f"{n_keys} keys in chunks of {chunks[:3]}{'...' if len(chunks) > 3 else ''}"
        cases.append(Case(what + (", scores of size ~1000" if spread > 10 else ""), run))
    return run_checks(fn, cases, "your online-softmax step")


def check_merge_splits(fn) -> bool:
    """fn(outs (splits, D) normalized per slice, lses (splits,) natural log) -> (D,) over all keys."""
    cases = []
    for n_keys, D, splits, spread, empty in [(64, 8, 4, 1.0, 0), (100, 4, 3, 40.0, 0), (40, 16, 5, 2.0, 2)]:
        def run(fn, n_keys=n_keys, D=D, splits=splits, spread=spread, empty=empty):
            g = torch.Generator().manual_seed(n_keys)
            s = torch.randn(n_keys, generator=g, dtype=torch.float64) * spread
            v = torch.randn(n_keys, D, generator=g, dtype=torch.float64)
            bounds = torch.linspace(0, n_keys, splits - empty + 1).long().tolist()
            outs, lses = [], []
            for a, b in zip(bounds, bounds[1:]):
                outs.append(torch.softmax(s[a:b], 0) @ v[a:b])
                lses.append(torch.logsumexp(s[a:b], 0))
            for _ in range(empty):                                   # slices past the end of a short cache
                outs.append(torch.zeros(D, dtype=torch.float64))
                lses.append(torch.tensor(float("-inf"), dtype=torch.float64))
            got = fn(torch.stack(outs), torch.stack(lses))
            want = torch.softmax(s, 0) @ v
            if getattr(got, "shape", None) != want.shape:
                return f"shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
            if not torch.isfinite(got).all():
                return "nan or inf: weigh each slice by exp(lse - max lse), so an empty slice weighs 0"
            err = (got - want).abs().max().item()
            return None if err < 1e-10 else f"differs from attention over all keys by up to {err:.2g}"
        cases.append(Case(f"{n_keys} keys in {splits} slices" + (f", {empty} of them empty" if empty else "")
                          + (", scores of size ~40" if spread > 10 else ""), run))
    return run_checks(fn, cases, "your merge")
