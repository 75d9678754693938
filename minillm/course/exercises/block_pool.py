"""Notebook 06: the block pool's three moves, written by the learner (grow with copy-on-write, fork, free),
checked against `BlockPool` and then run as the pool of a real engine.

The learner's functions get a pool (`_YourPool`, a `BlockPool` whose moves call them) with its state and
three helpers:

    pool.tables[seq], pool.lengths[seq]   a sequence's physical block ids and its token count
    pool.refcount[b]                      how many sequences hold block b
    pool.block_size
    pool.take() -> b                      a free block, its refcount set to 1
    pool.release(b)                       refcount - 1; at 0 the block is free again
    pool.copy_block(old, new, tokens)     copy the first `tokens` slots of K/V from block old to block new
"""
from __future__ import annotations

import random

import torch

from ...engine import LLMEngine
from ...kv.paged import BlockPool, OutOfBlocks
from .check import Case, learner_failed, run_checks


class _YourPool(BlockPool):
    """A BlockPool whose grow, fork and free_seq are the learner's (`moves`: (grow, fork, free))."""

    moves = None
    copies = 0

    def take(self) -> int:
        return self._take()

    def release(self, block: int) -> None:
        self._release(block)

    def copy_block(self, old: int, new: int, tokens: int) -> None:
        self._copy_block(old, new, tokens)                # BlockPool's own copy-on-write copy
        self.copies += 1

    def grow(self, seq: int, n: int = 1) -> None:
        if seq not in self.tables:
            raise KeyError(f"unknown sequence {seq}")
        need = self._new_blocks_needed(seq, n)        # refused before anything changes, as BlockPool does
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq} needs {need} more blocks, {self.num_free_blocks} free")
        self.moves[0](self, seq, n)

    def fork(self, parent: int, child: int) -> None:
        if child in self.tables:
            raise ValueError(f"sequence {child} already holds blocks")
        self.moves[1](self, parent, child)

    def free_seq(self, seq: int) -> None:
        self.moves[2](self, seq)


def _yours(moves, num_blocks: int, block_size: int) -> _YourPool:
    pool = _YourPool(None, num_blocks, block_size)
    pool.moves, pool.copy_log = moves, []
    return pool


def _shape(pool: BlockPool) -> tuple:
    """The pool's state up to the names of blocks: each sequence's length and its blocks, each block named
    by the order it is first met (so two pools that share and copy alike compare equal)."""
    names: dict[int, int] = {}
    seqs = tuple((s, pool.lengths.get(s), tuple(names.setdefault(b, len(names)) for b in pool.tables[s]))
                 for s in sorted(pool.tables))
    return seqs, pool.num_free_blocks


def _consistent(pool: BlockPool) -> str | None:
    held = [0] * pool.num_blocks
    for s, table in pool.tables.items():
        if len(table) != pool.blocks_for(pool.lengths.get(s, 0)):
            return f"sequence {s} holds {pool.lengths.get(s)} tokens in {len(table)} blocks (it needs {pool.blocks_for(pool.lengths.get(s, 0))})"
        for b in table:
            held[b] += 1
    if held != pool.refcount:
        b = next(i for i, (h, r) in enumerate(zip(held, pool.refcount)) if h != r)
        return f"block {b} is in {held[b]} tables but its refcount is {pool.refcount[b]}"
    free = list(pool.free)
    if sorted(free) != [b for b in range(pool.num_blocks) if held[b] == 0]:
        return "the free list is not exactly the blocks no sequence holds (release each block once, at its last user)"
    return None


def _replay(moves, ops, num_blocks: int, block_size: int) -> str | None:
    mine, ref = _yours(moves, num_blocks, block_size), BlockPool(None, num_blocks, block_size)
    ref.copy_log = []
    for op in ops:
        for pool in (ref, mine):
            kind, *args = op
            if kind == "new":
                pool.allocate(args[0], 0)
            else:
                getattr(pool, {"grow": "grow", "fork": "fork", "free": "free_seq"}[kind])(*args)
        if (problem := _consistent(mine)) is not None:
            return f"after {op}: {problem}"
        if _shape(mine) != _shape(ref):
            return f"after {op}: tables {mine.tables} and {mine.num_free_blocks} free, BlockPool has {ref.tables} and {ref.num_free_blocks} free"
        if [c[2] for c in mine.copy_log] != [c[2] for c in ref.copy_log]:
            return (f"after {op}: copies of {[c[2] for c in mine.copy_log]} tokens, BlockPool made "
                    f"{[c[2] for c in ref.copy_log]} (a shared block that is only partly full is copied before it is written)")
    return None


def _random_ops(rng: random.Random, n: int = 200) -> list[tuple]:
    ops, alive, next_id, lengths = [], [], 0, {}
    for _ in range(n):
        r = rng.random()
        if not alive or r < 0.15:
            ops.append(("new", next_id))
            alive.append(next_id)
            lengths[next_id] = 0
            next_id += 1
        elif r < 0.3 and len(alive) < 6:
            parent = rng.choice(alive)
            ops.append(("fork", parent, next_id))
            alive.append(next_id)
            next_id += 1
        elif r < 0.4 and len(alive) > 1:
            seq = rng.choice(alive)
            ops.append(("free", seq))
            alive.remove(seq)
        else:
            ops.append(("grow", rng.choice(alive), rng.choice([1, 1, 1, 2, 3, 5])))
    return ops


def check_block_pool(grow, fork, free) -> bool:
    """grow(pool, seq, n), fork(pool, parent, child), free(pool, seq): BlockPool's moves, on its state."""
    cases = {
        "a sequence grows into new blocks as tokens come": [("new", 0), ("grow", 0, 5), ("grow", 0, 1), ("grow", 0, 1),
                                                            ("grow", 0, 7)],
        "a fork shares every block, taking none": [("new", 0), ("grow", 0, 6), ("fork", 0, 1)],
        "a fork that grows copies the shared, partly full last block": [("new", 0), ("grow", 0, 6), ("fork", 0, 1),
                                                                        ("grow", 1, 1), ("grow", 0, 1)],
        "a full shared block is never copied": [("new", 0), ("grow", 0, 8), ("fork", 0, 1), ("grow", 1, 1)],
        "free gives blocks back; a shared one stays until its last user frees it": [
            ("new", 0), ("grow", 0, 6), ("fork", 0, 1), ("free", 0), ("grow", 1, 2), ("free", 1)],
    }
    out = [Case(name, lambda fns, ops=ops: _replay(fns, ops, 16, 4)) for name, ops in cases.items()]
    rng = random.Random(6)
    randoms = [_random_ops(rng) for _ in range(5)]

    def run_random(fns):
        for ops in randoms:
            if (problem := _replay(fns, ops, 400, 4)) is not None:
                return problem
        return None
    out.append(Case("5 x 200 random moves against BlockPool (blocks of 4, a pool of 400)", run_random))
    return run_checks((grow, fork, free), out, "your block pool")


def check_block_pool_in_engine(grow, fork, free, model, tok, prompts: list[list[int]], params, n: int,
                               **engine_options) -> bool:
    """The learner's moves as the block pool of an LLMEngine (no prefix cache): each prompt asked for
    n samples (params with a seed) (forks that share the prompt's blocks and copy the partly full one), in a pool small
    enough to preempt. Every sample's tokens must be those of the same engine with its own pool."""
    def run(pool_moves):
        engine = LLMEngine(model, tok, enable_prefix_caching=False, verbose=False, **engine_options)
        if pool_moves is not None:
            engine.kv.pool.__class__ = _YourPool
            engine.kv.pool.moves = pool_moves
        for i, p in enumerate(prompts):
            engine.add_request(i, p, params, n=n)
        done, steps = {}, 0
        with torch.inference_mode():
            while engine.has_unfinished_requests() and steps < 10_000:
                done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
                steps += 1
        return done, engine
    want, _ = run(None)
    try:
        got, engine = run((grow, fork, free))
    except Exception as e:
        return learner_failed(e, "your block pool", "inside the engine, led to")
    pool, stats = engine.kv.pool, engine.stats()
    wrong = [r for r in want if got.get(r) != want[r]]
    if wrong:
        print(f"✗ your block pool, inside the engine: sample {wrong[0]!r} answered {tok.decode(got.get(wrong[0], []))!r}, "
              f"with the engine's own pool {tok.decode(want[wrong[0]])!r}")
        return False
    if pool.num_free_blocks != pool.num_blocks:
        print(f"✗ your block pool, inside the engine: every request ended, yet {pool.num_blocks - pool.num_free_blocks} "
              "blocks are still taken")
        return False
    print(f"✓ your block pool ran the engine: {len(want)} samples of {len(prompts)} prompts, {pool.copies} "
          f"copies-on-write, {stats['num_preemptions']} preemptions; every sample's tokens are the engine's own, "
          "and every block is free again")
    return True
