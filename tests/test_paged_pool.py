"""The block pool's bookkeeping, under random sequences of admit / append / fork / free (hypothesis)."""
import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import pool_io

from minillm.config import ModelConfig
from minillm.kv import BlockPool, OutOfBlocks

TINY = ModelConfig(n_layers=2, d_model=8, n_heads=1, n_kv_heads=1, head_dim=2, ffn_dim=8, vocab_size=10)


def snapshot(pool):
    return (list(pool.free), list(pool.refcount), copy.deepcopy(pool.tables), dict(pool.lengths))


class PoolMachine(RuleBasedStateMachine):
    """Every token's K value is its sequence's own record of it, so reads check the data too."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(TINY, num_blocks=12, block_size=4)
        self.expected: dict[int, list[float]] = {}   # what each sequence must read back
        self.next_id = 0
        self.counter = 0.0

    def _write(self, seq, slots):
        vals = []
        for _ in range(len(slots)):
            self.counter += 1
            vals.append(self.counter)
        kv = torch.tensor(vals)[:, None, None].expand(-1, 1, 2)
        for layer in range(TINY.n_layers):
            pool_io.write(self.pool, layer, slots, kv, -kv)
        self.expected[seq] += vals

    @rule(n=st.integers(1, 20))
    def admit(self, n):
        seq, before = self.next_id, snapshot(self.pool)
        self.next_id += 1
        try:
            slots = self.pool.allocate(seq, n)
        except OutOfBlocks:
            assert snapshot(self.pool) == before, "a failed admit changed the pool"
            return
        self.expected[seq] = []
        self._write(seq, slots)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        before = snapshot(self.pool)
        try:
            slots = self.pool.append_slots(seq, n)
        except OutOfBlocks:
            assert snapshot(self.pool) == before, "a failed append changed the pool"
            return
        self._write(seq, slots)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.expected)))
        child = self.next_id
        self.next_id += 1
        self.pool.fork(parent, child)
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.pool.free_seq(seq)
        del self.expected[seq]

    @invariant()
    def counts_add_up(self):
        p = self.pool
        refs = [0] * p.num_blocks
        for table in p.tables.values():
            for b in table:
                refs[b] += 1
        assert refs == p.refcount, "reference counts do not match the tables"
        assert len(set(p.free)) == len(p.free), "a block is free twice"
        assert all(p.refcount[b] == 0 for b in p.free), "a free block is still referenced"
        used = sum(1 for r in p.refcount if r > 0)
        assert used + p.num_free_blocks == p.num_blocks
        for seq, table in p.tables.items():
            assert len(table) == p.blocks_for(p.lengths[seq])

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq, vals in self.expected.items():
            k, v = pool_io.gather(self.pool, 1, seq)
            assert k[:, 0, 0].tolist() == vals and v[:, 0, 1].tolist() == [-x for x in vals]

    def teardown(self):
        for seq in list(self.expected):
            self.pool.free_seq(seq)
        assert self.pool.num_free_blocks == self.pool.num_blocks and not any(self.pool.refcount)


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_slot_mapping_follows_the_block_table():
    pool = BlockPool(TINY, num_blocks=8, block_size=4)
    pool.allocate(0, 3)            # blocker: takes block 0
    slots = pool.allocate(1, 6)    # blocks 1, 2
    assert pool.tables[1] == [1, 2] and slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert pool.append_slots(1, 3).tolist() == [10, 11, 12]   # fills block 2, opens block 3
    assert pool.block_table([0, 1]).tolist() == [[0, 0, 0], [1, 2, 3]]


def test_fork_shares_blocks_and_copies_on_write():
    pool = BlockPool(TINY, num_blocks=8, block_size=4)
    pool.allocate(0, 6)            # one full block, one half-full
    free_before = pool.num_free_blocks
    pool.fork(0, 1)
    assert pool.num_free_blocks == free_before and pool.tables[1] == pool.tables[0]
    pool.append_slots(1, 1)        # the shared half-full block is copied for the child
    assert pool.tables[1][0] == pool.tables[0][0] and pool.tables[1][1] != pool.tables[0][1]
    assert pool.num_free_blocks == free_before - 1


def test_out_of_blocks_is_typed_and_clear():
    pool = BlockPool(TINY, num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks, match="needs 3 blocks, 2 free"):
        pool.allocate(0, 9)
    assert pool.num_free_blocks == 2 and not pool.tables
