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


def _accepts(p, q, x, u) -> bool:
    """The rule of speculative/verify.py: accept x when u · q(x) < p(x), probability min(1, p(x) / q(x))."""
    return float(p[x]) >= float(q[x]) or u * float(q[x]) < float(p[x])


def _random_pair(g: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    p, q = (torch.rand(vocab, generator=g) ** 4 for _ in range(2))
    return p / p.sum(), q / q.sum()


def check_accept_draft(fn) -> bool:
    """fn(p, q, x, u, generator) -> the token emitted for draft x: x itself when u · q(x) < p(x) (accepted
    with probability min(1, p(x) / q(x))), else a token drawn with `generator` from normalize(max(0, p − q)).
    Checked with chosen values of u for the accept test, and for exactness: over all u and the draft's
    choice of x, the emitted token must be distributed as p."""
    g = torch.Generator().manual_seed(4)
    example = (torch.tensor([0.10, 0.50, 0.30, 0.10]), torch.tensor([0.40, 0.40, 0.00, 0.20]))
    ruled_out = (torch.tensor([0.0, 0.6, 0.4]), torch.tensor([0.5, 0.25, 0.25]))
    randoms = [_random_pair(g, 6) for _ in range(3)]

    def emit(fn, p, q, x, u, gen):
        return int(fn(p.clone(), q.clone(), x, u, gen))

    def accept_test(fn):
        gen = torch.Generator().manual_seed(0)
        for p, q in [example, ruled_out, *randoms]:
            for x in range(len(p)):
                if q[x] == 0:
                    continue                                      # never drafted
                ratio = float(p[x] / q[x])
                for u in sorted({0.0, 0.999, max(ratio - 1e-3, 0.0), min(ratio + 1e-3, 0.999)}):
                    y, accept = emit(fn, p, q, x, u, gen), _accepts(p, q, x, u)
                    where = f"p = {_short(p)}, q = {_short(q)}, draft x = {x}, u = {u:.4f} (p(x)/q(x) = {ratio:.3f})"
                    if accept and y != x:
                        return f"{where}: got {y}; u < p(x)/q(x), so x is accepted"
                    if not accept and y == x:
                        return f"{where}: got x back; u ≥ p(x)/q(x), so x is rejected and replaced"
                    if not accept and p[y] <= q[y]:
                        return (f"{where}: rejected, then got token {y}, where p ≤ q; the replacement comes "
                                f"from normalize(max(0, p − q))")
        return None

    def greedy(fn):
        gen = torch.Generator().manual_seed(1)
        for p, q in randoms:
            best = int(p.argmax())
            one_hot = torch.nn.functional.one_hot(torch.tensor(best), len(p)).float()
            for x in range(len(p)):
                for u in (0.0, 0.5, 0.999):
                    if (y := emit(fn, one_hot, q, x, u, gen)) != best:
                        return f"p one-hot at {best}, q = {_short(q)}, draft {x}, u = {u}: got {y}, expected {best}"
        return None

    def one_hot_draft(fn):
        gen = torch.Generator().manual_seed(2)
        p = randoms[0][0]
        for x in range(len(p)):
            q = torch.nn.functional.one_hot(torch.tensor(x), len(p)).float()
            for u in (0.0, float(p[x]) - 1e-3, float(p[x]) + 1e-3, 0.999):
                if u < 0:
                    continue
                y = emit(fn, p, q, x, u, gen)
                if (y == x) != (u < float(p[x])):
                    return (f"p = {_short(p)}, q one-hot at the guess x = {x}, u = {u:.4f}: got {y}; accept x exactly "
                            f"when u < p(x) = {float(p[x]):.3f}")
        return None

    def replacement(fn, trials=4000):
        p, q = example
        gen = torch.Generator().manual_seed(3)
        counts = torch.zeros(len(p))
        for _ in range(trials):
            counts[emit(fn, p, q, 0, 0.9, gen)] += 1                 # x = 0 and u = 0.9: always rejected
        if counts[0]:
            return (f"p = {_short(p)}, q = {_short(q)}, draft 0, u = 0.9 ≥ p(0)/q(0) = 0.25: it must be rejected, "
                    f"but came back {int(counts[0])} times of {trials}")
        want = (p - q).clamp_min(0)
        want = want / want.sum()
        sd = (want * (1 - want) / trials).sqrt()                    # of each share, if the draws are right
        if ((counts / trials - want).abs() > 5 * sd).any():         # (5 sd: a right answer fails once in millions)
            return (f"p = {_short(p)}, q = {_short(q)}, draft 0 rejected {trials} times: replaced by each token "
                    f"{_short(counts / trials)} of the time, expected normalize(max(0, p − q)) = {_short(want)}")
        return None

    def distributed_as_p(fn, grid=2000):
        """Exact in u: every draft x (weighted by q(x)) tried at u = (j + 0.5) / grid, j = 0 .. grid − 1, so the
        accept test is integrated over u, not sampled; only the replacements are seeded draws."""
        gen = torch.Generator().manual_seed(5)
        for p, q in randoms:
            out = torch.zeros(len(p), dtype=torch.float64)
            for x in range(len(p)):
                for j in range(grid):
                    out[emit(fn, p, q, x, (j + 0.5) / grid, gen)] += float(q[x]) / grid
            p, q = p.double(), q.double()
            r = (p - q).clamp_min(0) / (p - q).clamp_min(0).sum()
            rejected = (1 - torch.minimum(p / q, torch.ones_like(p))) * grid              # rejections per x
            sd = ((q / grid) ** 2 * rejected).sum().sqrt() * (r * (1 - r)).sqrt()       # of out, if fn is right
            if ((out - p).abs() > 5 * sd + 2 / grid).any():                             # (+ the grid's own error)
                return (f"p = {_short(p)}, q = {_short(q)}: the emitted token is distributed as {_short(out)}, "
                        f"not as p")
        return None

    cases = [Case("the accept test: x exactly when u < p(x)/q(x), else a token where p > q", accept_test),
             Case("a greedy target (p one-hot): its argmax, whatever the draft and u", greedy),
             Case("a one-hot draft (n-gram lookup): x accepted exactly when u < p(x)", one_hot_draft),
             Case("a rejected draft is replaced from normalize(max(0, p − q)) (4,000 seeded draws)", replacement),
             Case("exactness: over u and x ~ q the emitted token is distributed as p (3 random pairs)",
                  distributed_as_p)]
    return run_checks(fn, cases, "your accept step")


def _short(t: torch.Tensor) -> list[float]:
    return [round(float(v), 3) for v in t]


def reference_lookup_speedup(tokens_per_pass: float, k_run: int, k: int, pass_cost: dict) -> float:
    """The speedup of a free proposer at k drafts, from a run at k_run: alpha (per judged draft) carries over."""
    from ...speculative import expected_tokens_per_step
    from ..speculative_bench import alpha_from_tokens_per_pass

    alpha = alpha_from_tokens_per_pass(tokens_per_pass, k_run)
    return expected_tokens_per_step(alpha, k) / pass_cost[k + 1]


def check_lookup_speedup(fn) -> bool:
    """fn(tokens_per_pass, k_run, k, pass_cost) -> speedup at k, on made-up runs: right within 1%, and the two
    tempting shortcuts (tokens per pass, or the share of drafts accepted, carried over from k_run) named."""
    costs = {T: 1.0 + 0.15 * (T - 1) for T in range(1, 10)}          # a pass over T tokens / a one-token step
    cases = []
    for name, tpp, k_run, k in [("a run at k = 4, predicted at k = 2", 2.6, 4, 2),
                                ("a run at k = 2, predicted at k = 6", 2.2, 2, 6),
                                ("drafts that always agree (α = 1)", 5.0, 4, 3),
                                ("drafts that never agree", 1.0, 4, 2)]:
        def run(fn, tpp=tpp, k_run=k_run, k=k):
            got, want = float(fn(tpp, k_run, k, dict(costs))), reference_lookup_speedup(tpp, k_run, k, costs)
            if abs(got / want - 1) < 0.01:
                return None
            share = (tpp - 1) / k_run                                   # drafts accepted / drafted
            if abs(got - min(tpp, k + 1) / costs[k + 1]) < 1e-6 * want:
                return (f"got {got:.3f}, expected {want:.3f}: tokens per pass depend on k; carry over what does "
                        "not (section 7)")
            if abs(got - (1 + share * k) / costs[k + 1]) < 1e-6 * want:
                return (f"got {got:.3f}, expected {want:.3f}: the share of drafts accepted falls as k grows; carry "
                        "over the chance a judged draft is accepted (section 7)")
            return f"got {got:.3f}, expected {want:.3f}"
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your speedup formula")
