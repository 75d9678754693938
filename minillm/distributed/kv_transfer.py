"""Moving a sequence's KV cache from one worker's block pool to another's, over torch.distributed
point-to-point: the building block of disaggregated serving (a prefill worker computes a prompt's K/V, a
decode worker continues the request from them).

    send_sequence(kv, seq, dst)     its length, then K and V of its blocks (every layer), in table order
    recv_sequence(kv, seq, src)     reserves blocks for that length in this pool and fills them

kv is the pool's KV-cache manager (`kv/manager.py`), which makes every change to the pool; seq a
sequence (anything with a `request_id`, e.g. `kv.manager.Sequence`).

Only the blocks in use travel, and they land wherever this pool has free blocks: the receiver's block
table is its own. A receive that fails midway (the sender died, the link timed out) frees what it took and
raises TransferFailed, so the caller can recompute the request from its tokens instead of losing it; so
does a receive into a pool with no room for the sequence (it takes the K/V off the link and drops them).
Float pools only; a quantized pool would send its codes and scales the same way.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..kv import BlockPool, kv_cache_bytes
from ..kv.paged import OutOfBlocks
from ..kv.manager import KVCacheManager, Sequence


class TransferFailed(RuntimeError):
    """The K/V did not arrive; nothing of the sequence is left in the receiving pool."""


def _check(pool: BlockPool) -> None:
    if pool.k is None or pool.kv_dtype:
        raise ValueError("send and receive need a float block pool with K/V tensors")


def send_sequence(kv: KVCacheManager, seq, dst: int, break_off: bool = False) -> dict:
    """Send seq's length and K/V blocks to rank dst; {"bytes", "seconds"} of the transfer.
    break_off: stop after K, as a link that fails midway would (to show and test the recompute)."""
    pool = kv.pool
    _check(pool)
    t0 = time.perf_counter()
    table = torch.tensor(kv.block_table(seq), dtype=torch.int64)
    dist.send(torch.tensor([kv.num_slots(seq)], dtype=torch.int64), dst)
    sent = 0
    for i, cache in enumerate((pool.k, pool.v)):
        ok = not (break_off and i == 1)
        dist.send(torch.tensor([int(ok)]), dst)          # each part announced, so a break-off stays in step
        if not ok:
            break
        blocks = cache[:, table].contiguous()          # (layers, blocks, block_size, n_kv, hd)
        dist.send(blocks, dst)
        sent += blocks.numel() * blocks.element_size()
    return {"bytes": sent, "seconds": time.perf_counter() - t0}


def recv_sequence(kv: KVCacheManager, seq, src: int, sender: str = "the sender") -> dict:
    """Receive a sequence from rank src into free blocks of this pool, as `seq`; {"bytes", "seconds",
    "length"}. Raises TransferFailed (and holds nothing for seq) if it does not all arrive."""
    pool = kv.pool
    _check(pool)
    t0 = time.perf_counter()
    length = torch.zeros(1, dtype=torch.int64)
    try:
        dist.recv(length, src)
    except RuntimeError as e:
        raise TransferFailed(f"no K/V header for sequence {seq.request_id} from rank {src}: {str(e).splitlines()[0]}") from None
    try:
        kv.reserve(seq, int(length))
    except OutOfBlocks as e:                            # no room: take the K/V off the link and drop it,
        _drain(pool, -(-int(length) // pool.block_size), src)      # so the next transfer stays in step
        raise TransferFailed(f"no room for the K/V of sequence {seq.request_id} ({int(length)} tokens): {e}; "
                             f"it is recomputed") from None
    table = torch.tensor(kv.block_table(seq), dtype=torch.int64)
    got = 0
    try:
        for cache in (pool.k, pool.v):
            ok = torch.zeros(1, dtype=torch.int64)
            dist.recv(ok, src)
            if not int(ok):
                raise TransferFailed(f"{sender} broke off after {got} bytes")
            blocks = torch.empty((cache.shape[0], len(table), *cache.shape[2:]), dtype=cache.dtype)
            dist.recv(blocks, src)
            cache[:, table] = blocks
            got += blocks.numel() * blocks.element_size()
    except TransferFailed:
        kv.free(seq)
        raise
    except RuntimeError as e:
        kv.free(seq)
        raise TransferFailed(f"K/V of sequence {seq.request_id} from rank {src} broke off after {got} bytes: "
                             f"{str(e).splitlines()[0]}") from None
    return {"bytes": got, "seconds": time.perf_counter() - t0, "length": int(length)}


def _drain(pool, num_blocks: int, src: int) -> None:
    """Receive a sequence's K and V from src into scratch memory and drop them."""
    for cache in (pool.k, pool.v):
        ok = torch.zeros(1, dtype=torch.int64)
        dist.recv(ok, src)
        if not int(ok):
            return
        dist.recv(torch.empty((cache.shape[0], num_blocks, *cache.shape[2:]), dtype=cache.dtype), src)


def transfer_costs(rank: int, world: int, lengths: list[int], repeats: int = 5) -> dict | None:
    """Run in 2 ranks (run_ranks): rank 0 sends sequences of each length of SmolLM2's float32 K/V to rank 1,
    `repeats` times, after one untimed transfer; rank 0 returns {length: {"bytes", "seconds" (median)}}."""
    import statistics

    from ..config import ModelConfig

    cfg = ModelConfig()
    kv = KVCacheManager(BlockPool(cfg, num_blocks=-(-max(lengths) // 16) + 1, block_size=16))
    seq = Sequence(0)
    out = {}
    for n in lengths[:1]:                        # untimed: the first messages open the ranks' connection
        dist.barrier()
        if rank == 0:
            kv.reserve(seq, n)
            send_sequence(kv, seq, dst=1)
            dist.recv(torch.zeros(1), 1)
        else:
            recv_sequence(kv, seq, src=0)
            dist.send(torch.zeros(1), 0)
        kv.free(seq)
    for n in lengths:
        times = []
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                kv.reserve(seq, n)
                t0 = time.perf_counter()
                send_sequence(kv, seq, dst=1)
                dist.recv(torch.zeros(1), 1)            # the receiver has it all: the transfer is over
                times.append(time.perf_counter() - t0)
            else:
                recv_sequence(kv, seq, src=0)
                dist.send(torch.zeros(1), 0)
            kv.free(seq)
        if rank == 0:
            out[n] = {"bytes": kv_cache_bytes(cfg, -(-n // 16) * 16), "seconds": statistics.median(times)}
    return out if rank == 0 else None
