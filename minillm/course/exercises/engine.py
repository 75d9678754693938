"""Notebook 07: how many decode steps each batching policy takes, and packing a step's tokens."""
from __future__ import annotations

import random

from ..simulate import simulate
from .check import Case, run_checks


def check_decode_steps(fn) -> bool:
    """fn(answer_lens, slots, policy) -> decode steps to finish every answer, all requests waiting at the
    start, one token per running request per step; checked against the engine's scheduler (simulate)."""
    rng = random.Random(7)
    workloads = [([90, 30, 7, 7, 8, 25, 48, 3], 4), ([5, 5, 5], 4), ([1, 9, 1, 9, 1], 2), ([12], 1)]
    workloads += [([rng.randint(1, 40) for _ in range(rng.randint(2, 14))], rng.randint(1, 6)) for _ in range(6)]
    cases = []
    for policy in ("static", "continuous"):
        def run(fn, policy=policy):
            for answers, slots in workloads:
                want = len(simulate([1] * len(answers), answers, policy=policy, max_num_seqs=slots))
                got = fn(list(answers), slots, policy)
                if got != want:
                    return f"answers {answers} in {slots} slots: got {got} steps, the scheduler takes {want}"
            return None
        cases.append(Case(f"{policy}: 10 workloads against the engine's scheduler", run))
    return run_checks(fn, cases, "your step count")


def _pack(requests):
    """The runner's packing (engine/runner.py), without speculative tokens."""
    positions, k_lens, logit_rows, n = [], [], [], 0
    for computed, new, total in requests:
        positions += range(computed, computed + new)
        k_lens.append(computed + new)
        n += new
        if computed + new == total:
            logit_rows.append(n - 1)
    return positions, k_lens, logit_rows


def check_pack(fn) -> bool:
    """fn(requests: list of (num_computed, num_new, num_tokens)) -> (positions, k_lens, logit_rows)."""
    rng = random.Random(3)
    batches = {
        "one prompt, whole": [(0, 5, 5)],
        "a prompt chunk that does not reach the end": [(0, 8, 11)],
        "three decodes": [(11, 1, 12), (3, 1, 4), (7, 1, 8)],
        "the notebook's step 1: a chunk's end beside two prompts": [(8, 3, 11), (0, 3, 3), (0, 2, 2)],
    }
    batches["8 random requests"] = []
    for _ in range(8):
        total = rng.randint(1, 60)
        computed = rng.randint(0, total - 1)
        batches["8 random requests"].append((computed, rng.randint(1, total - computed), total))
    cases = []
    for name, reqs in batches.items():
        def run(fn, reqs=reqs):
            got = fn(list(reqs))
            if not isinstance(got, tuple) or len(got) != 3:
                return "return a tuple (positions, k_lens, logit_rows)"
            for label, g, w in zip(("positions", "k_lens", "logit_rows"), got, _pack(reqs)):
                if list(g) != w:
                    return f"requests {reqs}: {label} {list(g)}, expected {w}"
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your packing")
