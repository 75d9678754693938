"""How much KV memory a trace of requests would hold, reserved up front or paged: notebook 06's numbers.

A request with a prompt of P tokens that generates N holds P + n tokens at its n-th decode step. What it
*reserves* depends on the policy:

    fixed         max_len slots from the start (a contiguous cache sized for the whole context)
    max_tokens    P + max_tokens slots (a contiguous cache sized for the longest answer allowed)
    oracle        P + N slots (a contiguous cache that knew the final length: no policy can do better
                  while reserving up front)
    paged         whole blocks, one more each time the last fills (kv/paged.py, replayed for real in a
                  bookkeeping-only BlockPool): the waste is the unfilled part of the last block, about
                  half a block per sequence
"""
from __future__ import annotations

from ..kv.paged import BlockPool, OutOfBlocks

POLICIES = ("fixed", "max_tokens", "oracle")


def reserved_slots(request: dict, policy: str, max_len: int = 4096, max_tokens: int = 1500) -> int:
    """Slots a contiguous cache reserves for one request ({"prompt_tokens", "output_tokens"}) under a policy."""
    if policy == "fixed":
        return max_len
    if policy == "max_tokens":
        return request["prompt_tokens"] + max_tokens
    if policy == "oracle":
        return request["prompt_tokens"] + request["output_tokens"]
    raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")


def reserved_utilization(trace: list[dict], policy: str, **kw) -> float:
    """Fraction of reserved slots that hold a token, summed over every decode step of every request."""
    used = reserved = 0
    for r in trace:
        P, N = r["prompt_tokens"], r["output_tokens"]
        used += N * P + N * (N - 1) // 2                # sum over n < N of (P + n)
        reserved += N * reserved_slots(r, policy, **kw)
    return used / reserved


def paged_utilization(trace: list[dict], block_size: int) -> float:
    """The same fraction with the paged pool: each request replayed in a bookkeeping-only BlockPool,
    admitted at its prompt and grown one token per step."""
    used = reserved = 0
    for r in trace:
        P, N = r["prompt_tokens"], r["output_tokens"]
        pool = BlockPool(None, num_blocks=(P + N) // block_size + 1, block_size=block_size)
        pool.allocate(0, P)
        for _ in range(N):
            used += pool.lengths[0]
            reserved += len(pool.tables[0]) * block_size
            pool.grow(0, 1)
    return used / reserved


def predicted_paged_utilization(trace: list[dict], block_size: int) -> float:
    """Before replaying: a sequence wastes on average (block_size - 1) / 2 slots of its last block."""
    used = sum(r["output_tokens"] * r["prompt_tokens"] + r["output_tokens"] * (r["output_tokens"] - 1) // 2
               for r in trace)
    waste = sum(r["output_tokens"] for r in trace) * (block_size - 1) / 2
    return used / (used + waste)


def sequences_that_fit(trace: list[dict], budget_tokens: int, policy: str, block_size: int = 16, **kw) -> int:
    """How many requests, taken in trace order, fit at once in a budget of `budget_tokens` slots.
    Contiguous policies: each reserves reserved_slots(); "paged_final": blocks for its final length
    (admitted at the end of its life: the most that can ever be resident at once, an upper bound)."""
    if policy == "paged_final":
        pool = BlockPool(None, num_blocks=budget_tokens // block_size, block_size=block_size)
        for i, r in enumerate(trace):
            try:
                pool.allocate(i, r["prompt_tokens"] + r["output_tokens"])
            except OutOfBlocks:
                return i
        return len(trace)
    total = 0
    for i, r in enumerate(trace):
        total += reserved_slots(r, policy, **kw)
        if total > budget_tokens:
            return i
    return len(trace)


def replay_concurrency(trace: list[dict], budget_tokens: int, policy: str, block_size: int = 16, **kw) -> dict:
    """Replay the trace through a KV budget, all requests waiting at the start, in order, one token per
    running request per step (prefill counted as one step, no chunking: only memory decides). Policies:
    the contiguous ones of `reserved_slots` (admit when the reservation fits, hold it to the end), or
    "paged" (admit when the prompt's blocks fit, grow block by block; when a sequence cannot grow, the
    most recently admitted one is preempted: its blocks are freed and it starts over later).
    Returns {"steps", "mean_running", "max_running", "preemptions", "regenerated_tokens" (answer tokens a
    preemption threw away, generated again one step at a time), "recomputed_prompt_tokens" (the prompts of
    preempted requests, computed again at their readmission), "answer_tokens" (the trace's, once each)}."""
    from collections import deque

    waiting = deque(range(len(trace)))
    running: list[int] = []                      # admission order
    done = {}                                    # request -> tokens generated so far
    free = budget_tokens
    pool = BlockPool(None, num_blocks=budget_tokens // block_size, block_size=block_size) if policy == "paged" else None
    steps = total_running = max_running = preemptions = regenerated = reprefilled = 0
    while waiting or running:
        while waiting:                           # admit in order while the head fits
            i = waiting[0]
            r = trace[i]
            if pool is not None:
                if not pool.can_admit(r["prompt_tokens"] + 1):
                    break
                pool.allocate(i, r["prompt_tokens"])
            else:
                need = reserved_slots(r, policy, **kw)
                if need > free:
                    if not running:
                        raise ValueError(f"request {i} reserves {need} slots, more than the budget")
                    break
                free -= need
            waiting.popleft()
            running.append(i)
            done[i] = 0
        steps += 1
        total_running += len(running)
        max_running = max(max_running, len(running))
        for i in list(running):
            if i not in running:                 # preempted earlier in this step
                continue
            if pool is not None:
                while not pool.can_append(i, 1):
                    victim = running.pop()       # the most recently admitted
                    pool.free_seq(victim)
                    waiting.appendleft(victim)
                    preemptions += 1
                    regenerated += done[victim]          # its answer so far: generated again, step by step
                    reprefilled += trace[victim]["prompt_tokens"]   # and its prompt computed again
                    if victim == i:
                        break
                if i not in running:
                    continue
                pool.grow(i, 1)
            done[i] += 1
            if done[i] == trace[i]["output_tokens"]:
                running.remove(i)
                if pool is not None:
                    pool.free_seq(i)
                else:
                    free += reserved_slots(trace[i], policy, **kw)
    return {"steps": steps, "mean_running": total_running / steps, "max_running": max_running,
            "preemptions": preemptions, "regenerated_tokens": regenerated, "recomputed_prompt_tokens": reprefilled,
            "answer_tokens": sum(r["output_tokens"] for r in trace)}
