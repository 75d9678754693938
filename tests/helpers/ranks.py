"""Functions the distributed tests run in every rank (importable by the spawned processes)."""
import os

import torch
import torch.distributed as dist
from helpers import pool_io


def sum_of_ranks(rank, world):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return float(x)


def rank_one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    dist.all_reduce(torch.zeros(1))       # rank 0 waits here for a partner that is gone
    return "unreachable"


def rank_one_dies(rank, world):
    if rank == 1:
        os._exit(3)                        # no exception, no message: the process is simply gone
    dist.all_reduce(torch.zeros(1))
    return "unreachable"


def _pool(seed, taken):
    """A small float pool with `taken` blocks held by another sequence, and sequence 7 written with
    seeded random K/V (on the sender) or nothing (on the receiver)."""
    from minillm.config import ModelConfig
    from minillm.kv import BlockPool

    cfg = ModelConfig(n_layers=2, n_heads=3, n_kv_heads=1, head_dim=8)
    pool = BlockPool(cfg, num_blocks=16, block_size=4)
    pool.allocate("other", 4 * taken)
    return pool


def kv_send_then_receive(rank, world):
    from minillm.distributed.kv_transfer import recv_sequence, send_sequence
    from minillm.kv.manager import KVCacheManager, Sequence

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 1, 8, generator=g), torch.randn(2, 10, 1, 8, generator=g)   # (layers, T, n_kv, hd)
    if rank == 0:
        pool = _pool(0, taken=1)
        slots = pool.allocate(7, 10)
        for layer in range(2):
            pool_io.write(pool, layer, slots, k[layer], v[layer])
        return send_sequence(KVCacheManager(pool), Sequence(7), dst=1)
    pool = _pool(1, taken=3)                               # the blocks land elsewhere here
    stats = recv_sequence(KVCacheManager(pool), Sequence(7), src=0)
    same = all(torch.equal(pool_io.gather(pool, layer, 7)[0], k[layer]) and torch.equal(pool_io.gather(pool, layer, 7)[1], v[layer])
               for layer in range(2))
    assert same and stats["length"] == 10 and pool.tables[7] != [1, 2, 3], (stats, pool.tables)
    return None


def kv_send_into_a_full_pool(rank, world):
    """Rank 1 sends sequence 7 (10 tokens: 3 blocks), then sequence 8 (4 tokens); rank 0 has 2 free blocks:
    7 fails with TransferFailed, holding nothing, and 8 still arrives whole (the link stayed in step)."""
    from minillm.distributed.kv_transfer import TransferFailed, recv_sequence, send_sequence
    from minillm.kv.manager import KVCacheManager, Sequence

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 1, 8, generator=g), torch.randn(2, 10, 1, 8, generator=g)   # (layers, T, n_kv, hd)
    if rank == 1:
        pool = _pool(0, taken=1)
        for rid, n in ((7, 10), (8, 4)):
            slots = pool.allocate(rid, n)
            for layer in range(2):
                pool_io.write(pool, layer, slots, k[layer, :n], v[layer, :n])
            send_sequence(KVCacheManager(pool), Sequence(rid), dst=0)
        return None
    pool = _pool(1, taken=14)                              # 2 of 16 blocks free
    kv = KVCacheManager(pool)
    try:
        recv_sequence(kv, Sequence(7), src=1)
        raise AssertionError("sequence 7 fit in 2 blocks")
    except TransferFailed as e:
        failed = str(e)
    assert 7 not in pool.tables and pool.num_free_blocks == 2
    recv_sequence(kv, Sequence(8), src=1)
    assert all(torch.equal(pool_io.gather(pool, layer, 8)[0], k[layer, :4]) for layer in range(2))
    return failed


def kv_sender_dies_midway(rank, world, report):
    """Rank 1 sends the header of a sequence, then dies; rank 0, receiving, writes what happened to `report`."""
    from minillm.distributed.kv_transfer import TransferFailed, recv_sequence
    from minillm.kv.manager import KVCacheManager, Sequence

    if rank == 1:
        dist.send(torch.tensor([10], dtype=torch.int64), 0)     # the header, then nothing
        os._exit(1)
    pool = _pool(1, taken=3)
    free = pool.num_free_blocks
    try:
        recv_sequence(KVCacheManager(pool), Sequence(7), src=1)
        outcome = "the transfer did not fail"
    except TransferFailed as e:
        kept = 7 in pool.tables or pool.num_free_blocks != free
        outcome = "kept blocks of a failed transfer" if kept else f"freed: {e}"
    with open(report, "w") as f:
        f.write(outcome)
    return outcome
