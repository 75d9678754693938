"""Notebook 05: the online-softmax step for a tile of query rows, and merging the partial results of flash-decoding's key slices."""
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


def reference_merge_states(o1, lse1, o2, lse2):
    """Two partial attention results over disjoint keys -> one over their union, itself mergeable.

    o1, o2 (R, D) each normalized over its own keys;  lse1, lse2 (R,) natural log, -inf for no keys."""
    m = torch.maximum(lse1, lse2)                                                 # (R,)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)                  # a row with no key on either side
    w1, w2 = torch.exp(lse1 - m_safe), torch.exp(lse2 - m_safe)                   # (R,) each side's share
    total = w1 + w2
    o = (w1[:, None] * o1 + w2[:, None] * o2) / torch.where(total > 0, total, 1.0)[:, None]   # 0 where empty
    return o, m_safe + torch.log(total)                                           # log 0 = -inf: still empty


def check_merge_states(fn) -> bool:
    """fn(o1, lse1, o2, lse2) -> (o, lse): merged results must merge again, in any order, to attention over
    all the keys; rows whose keys all lie past the cache's end stay empty (o = 0, lse = -inf), never nan."""
    def state(s, v, a, b):
        """The slice [a, b) of every row's keys: (o (R, D), lse (R,))."""
        if a >= b:
            return torch.zeros(s.shape[0], v.shape[-1], dtype=s.dtype), torch.full((s.shape[0],), float("-inf"), dtype=s.dtype)
        return torch.softmax(s[:, a:b], -1) @ v[a:b], torch.logsumexp(s[:, a:b], -1)

    def slices(n_keys, splits):
        bounds = torch.linspace(0, n_keys, splits + 1).long().tolist()
        return list(zip(bounds, bounds[1:]))

    def fold(fn, states):                           # left to right, as one program per row would
        o, lse = states[0]
        for o2, lse2 in states[1:]:
            o, lse = fn(o, lse, o2, lse2)
        return o, lse

    def tree(fn, states):                           # pairwise, as a reduction over programs would
        while len(states) > 1:
            states = [fn(*states[i], *states[i + 1]) if i + 1 < len(states) else states[i]
                      for i in range(0, len(states), 2)]
        return states[0]

    cases = []
    for name, n_keys, splits, spread, order in [
            ("2 slices of 64 keys", 128, 2, 1.0, fold),
            ("5 slices merged left to right, scores of size ~40", 100, 5, 40.0, fold),
            ("8 slices merged as a tree, the merged lse merged again", 96, 8, 3.0, tree),
            ("a short cache: the last 3 of 6 slices hold no keys", 30, 3, 2.0, fold)]:
        def run(fn, n_keys=n_keys, splits=splits, spread=spread, order=order, name=name):
            g = torch.Generator().manual_seed(n_keys + splits)
            R, D = 4, 8
            s = torch.randn(R, n_keys, generator=g, dtype=torch.float64) * spread   # (R, keys) scores
            v = torch.randn(n_keys, 8, generator=g, dtype=torch.float64)             # (keys, D)
            parts = [state(s, v, a, b) for a, b in slices(n_keys, splits)]
            if "short cache" in name:
                parts += [state(s, v, 0, 0)] * 3
            got = order(fn, parts)
            if not (isinstance(got, tuple) and len(got) == 2):
                return "return two things: the merged output (R, D) and its lse (R,)"
            o, lse = got
            want_o, want_lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
            if getattr(o, "shape", None) != (R, D) or getattr(lse, "shape", None) != (R,):
                return f"shapes {tuple(getattr(o, 'shape', ()))} and {tuple(getattr(lse, 'shape', ()))}, expected ({R}, {D}) and ({R},)"
            if not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
                return "nan or inf: weigh each side by exp(lse - the larger lse), so an empty side weighs 0"
            if (lse - want_lse).abs().max() > 1e-9:
                return (f"the merged lse is off by up to {(lse - want_lse).abs().max().item():.2g}: "
                        "it must be the log of the whole sum, so that the next merge can use it")
            err = (o - want_o).abs().max().item()
            return None if err < 1e-10 else f"differs from attention over all keys by up to {err:.2g}"
        cases.append(Case(name, run))

    def both_empty(fn):
        for dtype in (torch.float64, torch.float32):      # float32: the kernels' scratch, and vLLM's merge_state
            o, lse = state(torch.zeros(2, 0, dtype=dtype), torch.zeros(0, 8, dtype=dtype), 0, 0)
            got_o, got_lse = fn(o, lse, o.clone(), lse.clone())
            if torch.isnan(got_o).any() or torch.isnan(got_lse).any():
                return f"nan in {dtype}: two empty sides (lse = -inf on both) must merge to an empty state, not to 0/0"
            if not (torch.equal(got_o, o) and torch.isneginf(got_lse).all()):
                return "two empty sides must give o = 0 and lse = -inf"
        return None
    cases.append(Case("two empty slices (a row past both), in float64 and float32: still empty, no nan", both_empty))
    return run_checks(fn, cases, "your merge")
