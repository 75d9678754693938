"""Who does what in a tensor-parallel run: rank 0 leads, the other ranks follow.

Rank 0 owns the tokenizer, the sampling and the output. Before each forward pass it broadcasts what to
run (a prompt to prefill, or the token just sampled to decode) and then runs its own share of that pass.
The other ranks hold only their share of the weights and of the KV cache: they wait for an order, run the
same pass (the all-reduces inside it need every rank), and wait again. They never see text or sample
anything. STOP ends them.

    LeaderRunner(model, max_len)   rank 0's kv-stage runner: announces every prefill and decode
    follow(model)                  every other rank: run what rank 0 announces until it says STOP

An order is a header (op, number of token ids, max_len) and then the token ids, two broadcasts from rank 0.
If rank 0 fails, the followers' next broadcast times out (the process group's timeout), so nothing hangs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runners import KVCacheRunner

STOP, PREFILL, DECODE = 0, 1, 2


def announce(op: int, ids: list[int] = (), max_len: int = 0) -> None:
    """Rank 0: tell every rank what the next forward pass is."""
    dist.broadcast(torch.tensor([op, len(ids), max_len], dtype=torch.int64), 0)
    if len(ids):
        dist.broadcast(torch.tensor(ids, dtype=torch.int64), 0)


class LeaderRunner(KVCacheRunner):
    """The kv stage's runner on rank 0 of a tensor-parallel model: each pass is announced first."""

    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        if len(seqs) != 1:
            raise ValueError("a tensor-parallel run prefills one prompt at a time")
        announce(PREFILL, seqs[0], self.max_len)
        return super().prefill_batch(seqs)

    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        announce(DECODE, tokens)
        return super().decode_batch(tokens)

    def stop(self) -> None:
        """Release the followers (they return from follow)."""
        announce(STOP)


def follow(model) -> int:
    """Every rank but 0: run the passes rank 0 announces, on this rank's shard; return how many ran."""
    runner, passes = None, 0
    while True:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, 0)                                  # waits for rank 0's next order
        op, n, max_len = header.tolist()
        if op == STOP:
            return passes
        ids = torch.zeros(n, dtype=torch.int64)
        dist.broadcast(ids, 0)
        if op == PREFILL:
            runner = KVCacheRunner(model, max_len)                  # a fresh cache for a new prompt
            runner.prefill_batch([ids.tolist()])
        elif op == DECODE and runner is not None:
            runner.decode_batch(ids.tolist())
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: order {op} makes no sense here (no prompt yet?)")
        passes += 1
