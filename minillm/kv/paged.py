"""Stage 4: the paged KV cache — memory managed like an operating system's pages.

A contiguous cache reserves max_len slots per sequence up front; most of them hold nothing
for most of a request's life. Here one pool of fixed-size **blocks** (block_size tokens each)
serves every sequence, and a sequence gets blocks only as it grows:

    pool K, V: (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
    block table of a sequence: [physical block of tokens 0..bs-1, of tokens bs..2bs-1, ...]
    slot of token t: table[t // block_size] * block_size + t % block_size

Blocks carry reference counts, so sequences can share them: a forked sequence (parallel
sampling, a shared prompt) points at its parent's blocks; the first write into a shared,
partly filled block copies it first (copy-on-write). Free blocks wait in a deque.

With `kv_dtype="int8"` or `"int4"`, K and V are `QuantizedKV` (`quantized.py`): codes and a scale
per token and KV head, indexed like the float tensors, quantized on write.

Every operation checks before it changes anything: running out of blocks raises
`OutOfBlocks`, which a scheduler catches to preempt, and leaves the pool as it was.
"""
from __future__ import annotations

from collections import deque

import torch

from ..config import ModelConfig
from .quantized import kv_tensors


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """Where token `position` of a sequence with block table `table` sits in the pool, as one flat index."""
    return table[position // block_size] * block_size + position % block_size


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than the operation needs; nothing was changed."""


class BlockPool:
    def __init__(self, cfg: ModelConfig | None, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", kv_dtype: str | None = None):
        """cfg None: bookkeeping only (block tables, reference counts, the free list; no K/V tensors),
        for replaying a trace of requests to see how memory would be used."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.k = self.v = None
        if cfg is not None:
            shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
            self.k, self.v = kv_tensors(shape, dtype, device, kv_dtype)
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}   # sequence id -> physical block ids
        self.lengths: dict[int, int] = {}        # sequence id -> tokens stored
        self.copy_log: list[tuple[int, int, int]] | None = None   # a list: (from, to, tokens) of each copy-on-write

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)   # ceil

    def _new_blocks_needed(self, seq: int, n: int) -> int:
        """Blocks that appending n tokens to `seq` would take (a copy-on-write counts as one)."""
        length, table = self.lengths[seq], self.tables[seq]
        need = self.blocks_for(length + n) - len(table)
        if n > 0 and length % self.block_size and self.refcount[table[-1]] > 1:
            need += 1                            # the shared partial last block gets copied
        return need

    def can_admit(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= self.num_free_blocks

    def can_append(self, seq: int, n: int = 1) -> bool:
        return self._new_blocks_needed(seq, n) <= self.num_free_blocks

    # ------------------------------------------------------------ changes
    def _take(self) -> int:
        block = self.free.popleft()
        self.refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    def allocate(self, seq: int, n_tokens: int) -> torch.Tensor:
        """Admit a new sequence with n_tokens (its prompt); returns their slots (n_tokens,)."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already holds blocks")
        if not self.can_admit(n_tokens):
            raise OutOfBlocks(f"sequence {seq} needs {self.blocks_for(n_tokens)} blocks, {self.num_free_blocks} free")
        self.tables[seq], self.lengths[seq] = [], 0
        return self.append_slots(seq, n_tokens)

    def append_slots(self, seq: int, n: int = 1) -> torch.Tensor:
        """Grow `seq` by n tokens; returns the physical slots (n,) the new K/V must be written to."""
        length = self.lengths.get(seq, 0)
        self.grow(seq, n)
        return self.slots(seq, length, length + n)

    def grow(self, seq: int, n: int = 1) -> None:
        """`append_slots` without computing the slots (an engine computes them for a whole batch)."""
        if seq not in self.tables:
            raise KeyError(f"unknown sequence {seq}")
        need = self._new_blocks_needed(seq, n)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq} needs {need} more blocks, {self.num_free_blocks} free")
        table, length, bs = self.tables[seq], self.lengths[seq], self.block_size
        if n > 0 and length % bs and self.refcount[table[-1]] > 1:   # copy-on-write
            old, new = table[-1], self._take()
            self._copy_block(old, new, length % bs)
            self._release(old)
            table[-1] = new
        while len(table) < self.blocks_for(length + n):
            table.append(self._take())
        self.lengths[seq] = length + n

    def _copy_block(self, old: int, new: int, tokens: int) -> None:
        """Copy the first `tokens` slots of K/V from block old to block new (copy-on-write), and log it."""
        if self.copy_log is not None:                               # for pools that must copy too
            self.copy_log.append((old, new, tokens))
        if self.k is not None:
            self.k[:, new, :tokens] = self.k[:, old, :tokens]
            self.v[:, new, :tokens] = self.v[:, old, :tokens]

    def fork(self, parent: int, child: int) -> None:
        """`child` shares every block of `parent` (no copy, no new block)."""
        if child in self.tables:
            raise ValueError(f"sequence {child} already holds blocks")
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.tables[child]:
            self.refcount[block] += 1

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` tokens of `seq` (rejected speculative tokens go); whole blocks past
        them go back to the pool, last first. The K/V left in a kept block past `length` are never read."""
        table = self.tables[seq]
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq} to {length} tokens: it holds {self.lengths[seq]}")
        while len(table) > self.blocks_for(length):
            self._release(table.pop())
        self.lengths[seq] = length

    def free_seq(self, seq: int) -> None:
        """Give back a sequence's blocks (shared blocks stay until their last user frees them)."""
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]

    # ------------------------------------------------------------ addressing
    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        """Physical slots of tokens start..end-1 of `seq` (int64, on the pool's device)."""
        table = self.tables[seq]
        return torch.tensor([slot_of(table, t, self.block_size) for t in range(start, end)], device=self.device)

    def block_table(self, seqs: list[int]) -> torch.Tensor:
        """(len(seqs), max blocks) int32, padded with 0 (never read: lengths bound every access)."""
        width = max(len(self.tables[s]) for s in seqs)
        out = torch.zeros(len(seqs), max(width, 1), dtype=torch.int32)
        for i, s in enumerate(seqs):
            out[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return out.to(self.device)
