"""Notebook 07: how many decode steps each batching policy takes, one step of the scheduler, and packing a
step's tokens."""
from __future__ import annotations

import random
from types import SimpleNamespace

from ...engine.request import Request, Status
from ...engine.scheduler import Scheduler
from ...kv.manager import KVCacheManager
from ...kv.paged import BlockPool
from ...sampling import SamplingParams
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


def _engine_schedule(running, waiting, budget, max_seqs, free_blocks, block_size):
    """What the engine's own Scheduler decides in this state: (scheduled [(name, tokens)], preempted [names]).
    A running request (name, computed, left) holds the blocks of its `computed` tokens; a waiting one
    (name, left) holds none. No model, no prefix cache, no drafts."""
    held = sum(-(-computed // block_size) for _, computed, _ in running)
    kv = KVCacheManager(BlockPool(None, num_blocks=1 + held + free_blocks, block_size=block_size))
    kv.pool.allocate("someone else", 1)                   # (a pool has at least one block)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)

    def request(name, tokens):
        return Request(name, [1] * tokens, SamplingParams(max_tokens=1), output=SimpleNamespace(token_ids=[]))
    for name, computed, left in running:                  # in order of admission
        req = request(name, computed + left)
        kv.pool.allocate(name, computed)
        req.num_computed_tokens, req.status = computed, Status.RUNNING
        sched.running.append(req)
    for name, left in waiting:
        sched.add(request(name, left))
    batch = sched.schedule()
    return ([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)],
            [r.request_id for r in batch.preempted])


def _random_state(rng: random.Random):
    block_size = rng.choice([2, 4, 8, 16])
    running = []
    for i in range(rng.randint(0, 6)):
        if rng.random() < 0.7:
            running.append((f"r{i}", rng.randint(1, 60), 1))                       # decoding
        else:
            running.append((f"r{i}", rng.randint(1, 40), rng.randint(1, 80)))     # the rest of a prompt
    waiting = [(f"w{i}", rng.randint(1, 100)) for i in range(rng.randint(0, 5))]
    budget = rng.choice([rng.randint(1, 16), rng.randint(1, 128)])
    max_seqs = max(1, len(running) + rng.randint(0, 3))
    return running, waiting, budget, max_seqs, rng.randint(0, 10), block_size


def check_schedule(fn) -> bool:
    """fn(running, waiting, budget, max_seqs, free_blocks, block_size) -> (scheduled, preempted):
    scheduled [(name, tokens)] in the order taken, preempted [names] in the order preempted. Checked
    against the engine's own Scheduler, set up in the same state."""
    rng = random.Random(5)
    states = {   # running (name, computed, left), waiting (name, left), budget, max_seqs, free_blocks, block_size
        "three decodes, one token each": ([("a", 17, 1), ("b", 9, 1), ("c", 4, 1)], [], 8, 4, 4, 4),
        "a waiting prompt chunked to the budget left": ([("a", 17, 1)], [("b", 20)], 8, 4, 10, 4),
        "the budget runs out: later running requests wait": ([("a", 5, 30), ("b", 8, 1)], [("c", 3)], 16, 4, 20, 4),
        "admission stops at max_seqs": ([("a", 5, 1)], [("b", 2), ("c", 2), ("d", 2)], 32, 3, 20, 4),
        "first come, first served: nobody overtakes the head": ([("a", 8, 1)], [("b", 40), ("c", 2)], 64, 4, 3, 4),
        "no free block: the newest running request is preempted": ([("a", 8, 1), ("b", 6, 1), ("c", 7, 1)], [], 8, 4, 0, 4),
        "a request that preempts itself": ([("a", 3, 1), ("b", 8, 1)], [], 8, 4, 0, 4),
        "after a preemption nobody is admitted, though it would fit": ([("a", 8, 1), ("b", 5, 1)], [("c", 1)], 8, 4, 0, 4),
    }
    cases = []

    def compare(fn, state):
        running, waiting, *rest = state
        want = _engine_schedule(running, waiting, *rest)
        got = fn([tuple(r) for r in running], [tuple(w) for w in waiting], *rest)
        if not isinstance(got, tuple) or len(got) != 2:
            return "return a tuple (scheduled, preempted)"
        got = ([tuple(s) for s in got[0]], list(got[1]))
        if got != want:
            return (f"running {running}, waiting {waiting}, budget {rest[0]}, max_seqs {rest[1]}, "
                    f"free_blocks {rest[2]}, block_size {rest[3]}: got {got}, the engine's scheduler gives {want}")
        return None
    for name, state in states.items():
        cases.append(Case(name, lambda fn, state=state: compare(fn, state)))
    randoms = [_random_state(rng) for _ in range(300)]

    def run_random(fn):
        for state in randoms:
            if (problem := compare(fn, state)) is not None:
                return problem
        return None
    cases.append(Case("300 random states against the engine's scheduler", run_random))
    return run_checks(fn, cases, "your scheduler")
