"""Notebook 13: a rank's rows of the fused QKV weight, the bytes a disaggregated hand-over moves, and a ring
all-reduce over simulated ranks."""
from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import torch

from ..disaggregation import transfer_bytes
from ...distributed.tensor_parallel import qkv_rows
from .check import Case, run_checks


def check_qkv_shard(fn) -> bool:
    """fn(wqkv ((H + 2 n_kv) hd, d), n_heads, n_kv_heads, head_dim, rank, world) -> the rows rank keeps."""
    g = torch.Generator().manual_seed(13)
    cases = []
    for H, n_kv, hd, rank, world in [(9, 3, 4, 0, 3), (9, 3, 4, 2, 3), (8, 4, 2, 1, 2), (8, 2, 3, 1, 2), (4, 2, 2, 0, 1)]:
        cfg = SimpleNamespace(n_heads=H, n_kv_heads=n_kv, head_dim=hd)
        w = torch.randn((H + 2 * n_kv) * hd, 6, generator=g)

        def run(fn, w=w, cfg=cfg, rank=rank, world=world):
            want = w[qkv_rows(cfg, rank, world)]
            got = fn(w.clone(), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rank, world)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"expected {tuple(want.shape)} ({cfg.n_heads // world} query heads and " \
                       f"{cfg.n_kv_heads // world} K and V heads of {cfg.head_dim} rows), got {tuple(getattr(got, 'shape', ()))}"
            if torch.equal(got, want):
                return None
            n = len(want)
            if torch.equal(got, w[rank * n:(rank + 1) * n]):
                return "a contiguous slice mixes heads of different kinds: the fused weight is q heads | k heads | " \
                       "v heads, and a rank takes its part of each"
            first = next(i for i in range(n) if not torch.equal(got[i], want[i]))
            return f"row {first} of your shard is not the right row (q rows first, then k, then v)"
        cases.append(Case(f"{H} query heads, {n_kv} KV heads, rank {rank} of {world}", run))
    return run_checks(fn, cases, "your QKV shard")


def check_transfer_bytes(fn) -> bool:
    """fn(prompt_len, block_size, n_layers, n_kv_heads, head_dim, dtype_bytes) -> bytes the prefill worker sends."""
    smol = dict(n_layers=30, n_kv_heads=3, head_dim=64)
    cases = []
    for n, bs, dtype_bytes, shape in [(100, 16, 4, smol), (17, 16, 4, smol), (16, 16, 4, smol), (1000, 16, 2, smol),
                                      (50, 8, 4, dict(n_layers=2, n_kv_heads=1, head_dim=8))]:
        cfg = SimpleNamespace(**shape)

        def run(fn, n=n, bs=bs, dtype_bytes=dtype_bytes, cfg=cfg):
            want = transfer_bytes(cfg, n, bs, dtype_bytes)
            got = fn(n, bs, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype_bytes)
            if got == want:
                return None
            per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
            if got == per_token * n or got == per_token * -(-n // bs) * bs:
                return f"got {got:,}: only full blocks travel, and not the one holding the last prompt token " \
                       f"(the decode worker computes that token itself); expected {want:,}"
            if got * 2 == want:
                return f"got {got:,}, half of {want:,}: both K and V travel"
            return f"got {got:,}, expected {want:,}"
        cases.append(Case(f"a {n}-token prompt, blocks of {bs}, {dtype_bytes}-byte values", run))
    return run_checks(fn, cases, "your transfer size")


class Ring:
    """w simulated ranks in a ring, each able to talk to its right neighbour only. send(rank, values) puts
    a message in the inbox of rank + 1 (rank w - 1 sends to rank 0); recv(rank) takes the oldest message
    in rank's inbox, the one rank - 1 sent. It counts the messages and the values each rank sends."""

    def __init__(self, world: int):
        self.world = world
        self.inbox = [deque() for _ in range(world)]
        self.messages = [0] * world                       # messages each rank sent
        self.sent = [0] * world                           # values each rank sent, all messages together
        self.largest = 0                                  # values in the largest message

    def send(self, rank: int, values) -> None:
        values = list(values)
        self.inbox[(rank + 1) % self.world].append(values)
        self.messages[rank] += 1
        self.sent[rank] += len(values)
        self.largest = max(self.largest, len(values))

    def recv(self, rank: int) -> list:
        if not self.inbox[rank]:
            raise RuntimeError(f"rank {rank} waits for a message that rank {(rank - 1) % self.world} has not sent")
        return self.inbox[rank].popleft()


def _ring_problem(fn, vectors: list[list[int]]) -> str | None:
    w, P = len(vectors), len(vectors[0])
    ring = Ring(w)
    got = fn([list(v) for v in vectors], ring)
    want = [sum(col) for col in zip(*vectors)]
    if not isinstance(got, (list, tuple)) or len(got) != w:
        return f"expected a list of {w} vectors (one per rank), got {type(got).__name__}"
    for r, x in enumerate(got):
        x = list(x)
        if x == want:
            continue
        if len(x) != P:
            return f"rank {r} ends with {len(x)} values, expected {P}"
        if x == vectors[r]:
            return f"rank {r} still holds its own vector: nothing was added to it"
        wrong = [i for i in range(P) if x[i] != want[i]]
        hint = "after the reduce-scatter a rank holds the full sum of one chunk only: the all-gather passes " \
               "the sums on" if P - len(wrong) <= -(-P // w) else "which chunk does each rank send, and add to, at each step?"
        return f"rank {r} is wrong at {len(wrong)} of {P} positions (first: position {wrong[0]}, {x[wrong[0]]} " \
               f"instead of {want[wrong[0]]}): {hint}"
    left = [r for r in range(w) if ring.inbox[r]]
    if left:
        return f"rank {left[0]} never received {len(ring.inbox[left[0]])} message(s) sent to it"
    chunk = -(-P // w)
    if ring.largest > chunk:
        return f"a message carried {ring.largest} values; one chunk is at most {chunk} (P / w, rounded up): a ring " \
               "all-reduce sends chunks, never the whole vector"
    if ring.messages != [2 * (w - 1)] * w:
        return f"the ranks sent {ring.messages} messages; a ring all-reduce sends 2 (w − 1) = {2 * (w - 1)} from " \
               "each rank: w − 1 steps of reduce-scatter, then w − 1 of all-gather"
    formula = 2 * (w - 1) / w * P
    for r, n in enumerate(ring.sent):
        if (P % w == 0 and n != formula) or abs(n - formula) >= 2:
            return f"rank {r} sent {n} values; 2 (w − 1)/w × P = {formula:.4g}: split the vector into w chunks " \
                   "whose sizes differ by at most one, and send each chunk once per phase"
    return None


def check_ring_all_reduce(fn) -> bool:
    """fn(vectors, ring) -> every rank's vector after a ring all-reduce (each the sum of all of them);
    vectors[r] is rank r's vector, and ranks talk only through ring.send / ring.recv (a `Ring`)."""
    rng = random.Random(13)
    cases = []
    for w, P in [(2, 8), (3, 9), (4, 12), (3, 10), (4, 7), (5, 3), (8, 100), (1, 5)]:
        vectors = [[rng.randint(1, 9) for _ in range(P)] for _ in range(w)]   # > 0: a partial sum never looks full
        sent = 2 * (w - 1) / w * P
        cases.append(Case(f"{w} rank{'s' if w > 1 else ''}, {P} values: each sends 2 (w − 1)/w × P "
                          f"{'=' if sent == int(sent) else '≈'} {sent:.4g} values",
                          lambda fn, vectors=vectors: _ring_problem(fn, vectors)))
    return run_checks(fn, cases, "your ring all-reduce")
