"""Notebook 05: the online-softmax step for a tile of query rows, and merging the key slices of flash-decoding."""
from __future__ import annotations

import torch

from .check import Case, run_checks


def reference_online_tile(m, l, acc, s, v):
    """One tile of the online softmax for M query rows at once.

    m, l (M,) each row's running max and sum;  acc (M, D) its unnormalized output;
    s (M, n) the tile's scores, -inf where the causal mask hides a key;  v (n, D) the tile's values."""
    m_new = torch.maximum(m, s.amax(-1))                                          # (M,)
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)     # a row with no key yet
    alpha = torch.exp(m - m_safe)                                                 # (M,) rescale the old sums
    p = torch.exp(s - m_safe[:, None])                                            # (M, n)
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


def _tile_case(rows: int, n_keys: int, D: int, block: int, spread: float, causal: bool, seed: int,
               padding: int = 0) -> Case:
    def run(fn):
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(rows, n_keys, generator=g, dtype=torch.float64) * spread   # (M, S) one block's scores
        v = torch.randn(n_keys, D, generator=g, dtype=torch.float64)               # (S, D)
        if causal:                                   # row i sees keys 0 .. i + (S - M): bottom-right, as a kernel
            hidden = torch.arange(n_keys)[None, :] > torch.arange(rows)[:, None] + (n_keys - rows)
            s = s.masked_fill(hidden, float("-inf"))
        s[:, :padding] = float("-inf")               # left padding of a batch: keys no row may see
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros(rows, dtype=torch.float64), torch.zeros(rows, D, dtype=torch.float64)
        for j in range(0, n_keys, block):
            out = fn(m, l, acc, s[:, j:j + block], v[j:j + block])
            if not (isinstance(out, tuple) and len(out) == 3):
                return "return the triple (m, l, acc)"
            m, l, acc = out
            if tuple(m.shape) != (rows,) or tuple(l.shape) != (rows,) or tuple(acc.shape) != (rows, D):
                return (f"after the tile at key {j}: shapes m {tuple(m.shape)}, l {tuple(l.shape)}, acc "
                        f"{tuple(acc.shape)}; expected ({rows},), ({rows},), ({rows}, {D})")
            if not (torch.isfinite(l).all() and torch.isfinite(acc).all()):
                if spread > 10:
                    return "nan or inf: exp of scores ~1000 overflows; subtract the running max before exp"
                return (f"nan or inf after the tile at key {j}: a row whose keys in a tile are all hidden (-inf) "
                        "must keep its state, without computing -inf - (-inf)")
        want = torch.softmax(s, -1) @ v                                              # (M, D)
        if not torch.equal(m, s.amax(-1)):
            return "the running max after the last tile is not each row's largest score"
        err = (acc / l[:, None] - want).abs().max().item()
        if err < 1e-10:
            return None
        if spread > 10:
            return f"differs from softmax by {err:.2g}: with large scores, subtract the running max before exp"
        return (f"acc / l differs from softmax(s) @ v by up to {err:.2g}: rescale each row's l and acc by "
                "exp(m_old - m_new), its own")
    what = (f"{rows} query rows, {n_keys} keys in tiles of {block}" + (", causal" if causal else "")
            + (", scores of size ~1000" if spread > 10 else "")
            + (f", the first {padding} keys padding (hidden from every row)" if padding else ""))
    return Case(what, run)


def check_online_softmax(fn) -> bool:
    """fn(m (M,), l (M,), acc (M, D), s (M, n), v (n, D)) -> (m, l, acc) after one more tile of keys."""
    cases = [_tile_case(1, 10, 4, 4, 3.0, False, 0),         # section 2's row, as a block of one
             _tile_case(6, 33, 8, 1, 1.0, False, 1),         # one key at a time
             _tile_case(8, 50, 16, 16, 1000.0, False, 2),
             _tile_case(16, 16, 4, 4, 3.0, True, 3),         # a diagonal block: early rows see nothing of later tiles
             _tile_case(5, 37, 8, 8, 3.0, True, 4),          # a cached prefix and a ragged last tile
             _tile_case(4, 20, 8, 4, 3.0, True, 5, padding=6)]   # whole tiles that no row may see, first
    return run_checks(fn, cases, "your online-softmax tile")


def tiled_with(step, block: int = 16):
    """The model's attention function, tiled, with step(m, l, acc, s, v) updating a query block's state one
    key tile at a time: q (B, H, T, hd), k, v (B, n_kv, S, hd) -> (B, H, T, hd), causal, bottom-right. The
    query heads that share a key/value head go through one step together, as rows of one block."""
    def attn(q, k, v, mask=None):
        B, H, T, hd = q.shape
        n_kv, S = k.shape[1], k.shape[2]
        group = H // n_kv
        out = torch.empty_like(q)
        for b in range(B):
            for kv in range(n_kv):
                kh, vh = k[b, kv].float(), v[b, kv].float()                              # (S, hd)
                for i in range(0, T, block):
                    qi = q[b, kv * group:(kv + 1) * group, i:i + block].float() / hd ** 0.5   # (group, bm, hd)
                    bm = qi.shape[1]
                    qi = qi.reshape(group * bm, hd)                                       # (M, hd): rows of the block
                    pos = (torch.arange(i, i + bm) + (S - T)).repeat(group)               # (M,) their key positions
                    m = torch.full((group * bm,), float("-inf"))
                    l, acc = torch.zeros(group * bm), torch.zeros(group * bm, hd)
                    for j in range(0, i + bm + (S - T), block):                           # later tiles: all hidden
                        s = qi @ kh[j:j + block].T                                        # (M, n)
                        s = s.masked_fill(torch.arange(j, j + s.shape[1])[None, :] > pos[:, None], float("-inf"))
                        m, l, acc = step(m, l, acc, s, vh[j:j + block])
                    out[b, kv * group:(kv + 1) * group, i:i + block] = (acc / l[:, None]).reshape(group, bm, hd).to(q.dtype)
        return out
    return attn


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
