"""Notebook 09: the chain of block addresses, and how many prompt tokens the cache can serve."""
from __future__ import annotations

import random

from ...kv.prefix_cache import chain_hashes
from .check import Case, run_checks


def check_chain(fn) -> bool:
    """fn(token_ids, block_size) -> one address per full block, each hash_block(parent address, block tokens)."""
    rng = random.Random(5)
    cases = []
    for n, bs in [(64, 16), (62, 16), (15, 16), (0, 16), (40, 4), (9, 1)]:
        ids = [rng.randrange(49152) for _ in range(n)]

        def run(fn, ids=ids, bs=bs):
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
