"""Notebook 09: the chain of block addresses, how many prompt tokens the cache can serve, and which parked
block is evicted first."""
from __future__ import annotations

import random

from ...kv.prefix_cache import PrefixCachingPool, chain_hashes
from .check import Case, run_checks


def check_chain(fn) -> bool:
    """fn(token_ids, block_size) -> one address per full block, each hash_block(parent address, block tokens)."""
    rng = random.Random(5)
    cases = []
    for n, bs in [(64, 16), (62, 16), (15, 16), (0, 16), (40, 4), (9, 1)]:
        ids = [rng.randrange(49152) for _ in range(n)]

        def run(fn, ids=ids, bs=bs):
            if fn is chain_hashes:
                return "that is minillm's own chain_hashes, the answer the check compares with: write it with hash_block"
            want = chain_hashes(ids, bs)
            got = list(fn(list(ids), bs))
            if len(got) != len(want):
                return f"{len(ids)} tokens in blocks of {bs}: got {len(got)} addresses, expected {len(want)} " \
                       "(one per *full* block; a partial last block has none)"
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    hint = " (block 0 has no parent: pass None)" if i == 0 else " (is the parent the previous block's address?)"
                    return f"block {i}: got {g.hex()[:8]}, expected {w.hex()[:8]}{hint}"
            return None
        cases.append(Case(f"{n} tokens, blocks of {bs}", run))
    return run_checks(fn, cases, "your chain")


def check_cached_tokens(fn) -> bool:
    """fn(addresses, cached, num_tokens, block_size) -> prompt tokens whose K/V the cache already holds."""
    A = [bytes([i]) * 16 for i in range(8)]       # stand-in addresses of an 8-block chain
    cases = []
    for name, addresses, cached, n, bs, want in [
        ("nothing cached", A[:4], set(), 64, 16, 0),
        ("the first two blocks cached", A[:4], set(A[:2]), 64, 16, 32),
        ("a gap: block 1 evicted", A[:4], {A[0], A[2], A[3]}, 64, 16, 16),
        ("all cached, prompt ends mid-block", A[:4], set(A[:4]), 70, 16, 64),
        ("all cached, prompt ends on a block boundary", A[:4], set(A[:4]), 64, 16, 48),
        ("blocks of 1, all cached", A[:8], set(A), 8, 1, 7),
    ]:
        def run(fn, addresses=addresses, cached=cached, n=n, bs=bs, want=want):
            got = fn(list(addresses), set(cached), n, bs)
            if got != want:
                hint = ""
                if want < len(addresses) * bs and got == len(addresses) * bs:
                    hint = " (the last token must be computed: its logits give the first answer token)"
                return f"{n} prompt tokens: got {got}, expected {want}{hint}"
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your lookup")



class _Trace:
    """Requests run through the engine's PrefixCachingPool (bookkeeping only, blocks of one token),
    recording each operation a learner's LRU must repeat and what the pool did. Every block a request
    takes is registered at once, so a block whose last user lets go is always parked, never freed."""

    def __init__(self, num_blocks: int):
        self.pool = PrefixCachingPool(None, num_blocks, block_size=1)
        self.chains: dict[str, list[bytes]] = {}          # request -> the addresses of its blocks
        self.ops: list[tuple] = []                        # (what, request, argument, expected, parked after, held)
        self.addresses = 0

    def hits(self, source: str | None, k: int) -> list[int]:
        """The cached blocks of the first k blocks of request source's chain (the pool's own lookup)."""
        chain = self.chains[source][:k] if source else []
        return self.pool.lookup(chain, [int.from_bytes(a, "big") for a in chain])

    def start(self, rid: str, n_new: int, source: str | None = None, k: int = 0) -> None:
        """A new request: the cached beginning (up to k blocks) of `source`'s chain, then n_new new blocks."""
        hit = self.hits(source, k)
        self.pool.allocate(rid, 0)                        # as the engine admits a request (kv/manager.py)
        if hit:
            self.pool.share(rid, hit)
        self.ops.append(("reuse", rid, list(hit), None, list(self.pool.evictable), set()))
        parked = set(self.pool.evictable)
        self.pool.grow(rid, n_new)
        new = self.pool.tables[rid][len(hit):]
        chain = self.chains[source][:len(hit)] if source else []
        for b in new:
            self.addresses += 1
            chain.append(self.addresses.to_bytes(16, "big"))
            self.pool.register(b, chain[-1], [self.addresses])
        self.chains[rid] = chain
        self.ops.append(("allocate", rid, n_new, (list(new), [b for b in new if b in parked]),
                         list(self.pool.evictable), set()))

    def end(self, rid: str) -> None:
        blocks = list(self.pool.tables[rid])
        self.pool.free_seq(rid)
        self.ops.append(("release", rid, blocks, None, list(self.pool.evictable),
                         {b for b in blocks if self.pool.refcount[b] > 0}))


def _random_trace(seed: int, num_blocks: int, n_ops: int) -> _Trace:
    """Requests that start (most reusing the beginning of an earlier one) and end, in a random order."""
    rng, t, live = random.Random(seed), _Trace(num_blocks), []
    for i in range(n_ops):
        source = rng.choice(sorted(t.chains)) if t.chains and rng.random() < 0.7 else None
        k = rng.randint(1, 4)
        room = t.pool.num_free_blocks - t.pool.blocks_to_reuse(t.hits(source, k))
        if live and (rng.random() < 0.4 or room < 1):
            t.end(live.pop(rng.randrange(len(live))))
        elif room >= 1:
            t.start(f"r{i}", rng.randint(1, min(4, room)), source, k)
            live.append(f"r{i}")
    return t


def _lru_scripts() -> list[tuple[str, _Trace]]:
    def script(num_blocks, steps):
        t = _Trace(num_blocks)
        for what, *args in steps:
            if what == "start":
                t.start(*args)
            else:
                t.end(*args)
        return t
    return [
        ("a request ends: its blocks are parked, last block first",
         script(8, [("start", "a", 3), ("end", "a")])),
        ("never-used blocks are taken before parked ones",
         script(8, [("start", "a", 3), ("end", "a"), ("start", "b", 3)])),
        ("with none left, the least recently used parked block is evicted",
         script(6, [("start", "a", 3), ("end", "a"), ("start", "b", 3), ("end", "b"), ("start", "c", 2)])),
        ("a hit takes its blocks out of the parked list",
         script(8, [("start", "a", 3), ("end", "a"), ("start", "b", 1, "a", 2), ("end", "b")])),
        ("a shared block is parked only when its last user ends",
         script(8, [("start", "a", 2), ("start", "b", 1, "a", 2), ("end", "a"), ("end", "b")])),
    ] + [(f"{n} random operations on a pool of {blocks} blocks (seed {seed})", _random_trace(seed, blocks, n))
         for seed, blocks, n in [(0, 8, 40), (1, 12, 60), (2, 16, 80), (3, 6, 60)]]


def _lru_problem(lru, trace: _Trace) -> str | None:
    for i, (what, rid, arg, want, parked, held) in enumerate(trace.ops):
        if what == "reuse":
            lru.reuse(list(arg))
            done = f"request {rid} found blocks {arg} in the cache"
        elif what == "release":
            lru.release(list(arg))
            done = f"request {rid} ended (its blocks {arg})"
        else:
            got = lru.allocate(arg)
            done = f"request {rid} took {arg} new block{'s' if arg > 1 else ''}"
            if not (isinstance(got, tuple) and len(got) == 2):
                return f"{done}: allocate returned {got!r}; expected a pair (blocks taken, blocks evicted)"
            blocks, evicted = list(got[0]), list(got[1])
            if (blocks, evicted) != want:
                hint = ""
                if evicted and not want[1]:
                    hint = " (never-used free blocks were left: take those first)"
                elif want[1] and len(evicted) == len(want[1]) and set(evicted) != set(want[1]):
                    hint = " (evict the least recently used: the front of the parked OrderedDict)"
                return f"operation {i + 1}, {done}: got {blocks} (evicted {evicted}), expected {want[0]} (evicted {want[1]}){hint}"
        got_parked = list(lru.parked)
        if got_parked != parked:
            hint = ""
            if what == "reuse" and set(arg) & set(got_parked):
                hint = f" (block {sorted(set(arg) & set(got_parked))[0]} has a user again: take it out of parked)"
            elif held & set(got_parked):
                hint = f" (block {sorted(held & set(got_parked))[0]} is still held by another request: park a " \
                       "block only when its last user lets go)"
            elif sorted(got_parked) == sorted(parked):
                hint = " (the same blocks, in another order: release a request's blocks last block first, each " \
                       "at the most recently used end)"
            return f"operation {i + 1}, {done}: parked is {got_parked}, expected {parked}{hint}"
    return None


def check_lru(cls) -> bool:
    """cls(num_blocks) with .parked (an OrderedDict, least recently used first), .reuse(blocks),
    .allocate(n) -> (blocks taken, blocks evicted) and .release(blocks): driven through the same requests
    as the engine's PrefixCachingPool, compared after every operation."""
    cases = [Case(name, lambda cls, trace=trace: _lru_problem(cls(trace.pool.num_blocks), trace))
             for name, trace in _lru_scripts()]
    return run_checks(cls, cases, "your LRU")
