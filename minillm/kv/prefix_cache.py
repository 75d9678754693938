"""Automatic prefix caching: find K/V blocks by their content, and keep them after their request ends.

Requests often begin the same way (a system prompt, a chat's history, one document and several
questions). K/V of a token depend only on it and the tokens before it, so two requests with the
same first 512 tokens need the same 512 tokens' K/V. A full block gets a content address:

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys)      a chain

so one hash names the whole prefix up to and including that block (the same 16 tokens after a
different history get a different hash). `extra` leaves room for keys that must keep caches
apart, such as a per-user salt. H is BLAKE2b with a 128-bit digest: for two different prefixes
to share an address by accident, with a billion cached blocks, has a probability around 10^-21,
far below that of a hardware fault; the block's token ids are compared on a hit all the same.

`PrefixCachingPool` is stage 4's `BlockPool` with three changes:
- a full block can be *registered* under its hash once its K/V are computed;
- a registered block whose last user lets go is not freed but parked in an *evictable* list,
  least recently used first, its K/V intact, findable by `lookup`;
- allocation takes never-used (or unregistered) free blocks first, and only then evicts the least
  recently used parked block, dropping its hash.
A sequence's blocks are released tail first, so the end of a chain is evicted before its start.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .paged import BlockPool


def hash_block(parent: bytes | None, tokens, extra: bytes | str | None = None) -> bytes:
    """The 128-bit content address of a full block: its parent's address, its tokens, extra keys."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra is not None:
        h.update(extra.encode() if isinstance(extra, str) else extra)
    return h.digest()


def chain_hashes(token_ids: list[int], block_size: int, extra=None, known: list[bytes] | None = None) -> list[bytes]:
    """Addresses of every full block of token_ids, extending `known` (the addresses computed before)."""
    out = list(known or [])
    for i in range(len(out), len(token_ids) // block_size):
        out.append(hash_block(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size],
                              extra if i == 0 else None))
    return out


class PrefixCachingPool(BlockPool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cached: dict[bytes, int] = {}                          # content address -> block
        self.block_key: dict[int, tuple[bytes, tuple]] = {}         # block -> (address, its token ids)
        self.evictable: OrderedDict[int, None] = OrderedDict()      # refcount 0, still cached; oldest first
        self.num_evictions = 0

    # ------------------------------------------------------------ what is free
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    def _take(self) -> int:
        if self.free:
            return super()._take()
        block, _ = self.evictable.popitem(last=False)                # the least recently used
        address, _ = self.block_key.pop(block)
        del self.cached[address]
        self.num_evictions += 1
        self.refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.block_key:
                self.evictable[block] = None                        # most recently used end
            else:
                self.free.append(block)

    def free_seq(self, seq) -> None:
        """Give back a sequence's blocks, last block first (so a chain is evicted from its end)."""
        for block in reversed(self.tables.pop(seq)):
            self._release(block)
        del self.lengths[seq]

    # ------------------------------------------------------------ content addresses
    def lookup(self, addresses: list[bytes], token_ids: list[int]) -> list[int]:
        """The blocks holding the longest cached prefix of this chain (token ids checked)."""
        blocks = []
        for i, address in enumerate(addresses):
            block = self.cached.get(address)
            if block is None or self.block_key[block][1] != tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]):
                break
            blocks.append(block)
        return blocks

    def blocks_to_reuse(self, blocks: list[int]) -> int:
        """How many free-list slots taking these cached blocks uses up (the parked ones)."""
        return sum(1 for b in blocks if self.refcount[b] == 0)

    def share(self, seq, blocks: list[int]) -> None:
        """Start `seq` (holding nothing yet) with these cached blocks as its first ones."""
        if self.tables[seq]:
            raise ValueError(f"sequence {seq} already holds blocks")
        for b in blocks:
            if self.refcount[b] == 0:
                del self.evictable[b]
            self.refcount[b] += 1
        self.tables[seq] = list(blocks)
        self.lengths[seq] = len(blocks) * self.block_size

    def register(self, block: int, address: bytes, tokens) -> bool:
        """Make a full, computed block findable by its address. False when another block already
        holds that content (two requests computed the same new prefix at once): this one stays private."""
        if address in self.cached or block in self.block_key:
            return False
        self.cached[address] = block
        self.block_key[block] = (address, tuple(tokens))
        return True
