"""Notebook 06: a block-table lookup, and how many new blocks a sequence needs to grow."""
from __future__ import annotations

import random

from ...kv import BlockPool
from .check import Case, run_checks


def check_slot_lookup(fn) -> bool:
    """fn(block_table: list[int], block_size, position) -> the physical slot that holds that position."""
    cases = []
    for block_size, n_tokens, seed in [(4, 9, 0), (16, 100, 1), (1, 5, 2)]:
        def run(fn, block_size=block_size, n_tokens=n_tokens, seed=seed):
            pool = BlockPool(None, num_blocks=64, block_size=block_size)
            rng = random.Random(seed)
            pool.allocate(1, 1)                                  # a blocker, so tables interleave
            pool.allocate(0, 1)
            for _ in range(n_tokens - 1):
                pool.grow(rng.choice([0, 1]) if pool.lengths[1] < 60 else 0, 1)
            want = pool.slots(0, 0, pool.lengths[0]).tolist()
            for pos, slot in enumerate(want):
                got = fn(list(pool.tables[0]), block_size, pos)
                if got != slot:
                    block = pool.tables[0][pos // block_size]
                    return (f"position {pos} with table {pool.tables[0]}: got {got}, expected {slot} "
                            f"(logical block {pos // block_size} -> physical {block}, offset {pos % block_size})")
            return None
        cases.append(Case(f"block size {block_size}, a sequence interleaved with another", run))
    return run_checks(fn, cases, "your slot lookup")


def check_blocks_needed(fn) -> bool:
    """fn(length, n, block_size) -> new blocks a sequence of `length` tokens needs to hold n more."""
    cases = []
    for block_size in (16, 1, 7):
        def run(fn, block_size=block_size):
            for length in range(0, 3 * block_size + 2):
                for n in range(0, 2 * block_size + 2):
                    want = -(-(length + n) // block_size) - -(-length // block_size)
                    got = fn(length, n, block_size)
                    if got != want:
                        return f"length {length}, {n} more tokens: got {got}, expected {want}"
            return None
        cases.append(Case(f"block size {block_size}, every length and growth up to 2 blocks", run))
    return run_checks(fn, cases, "your block count")
