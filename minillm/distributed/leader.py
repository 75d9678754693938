"""Who does what in a tensor-parallel run: rank 0 leads, the other ranks follow.

Rank 0 owns the tokenizer, the scheduler (when it runs the engine), the sampling and the output. Before
each forward pass it broadcasts what to run (a prompt to prefill, the token just sampled to decode, or an
engine step) and then runs its own share of that pass.
The other ranks hold only their share of the weights and of the KV cache: they wait for an order, run the
same pass (the all-reduces inside it need every rank), and wait again. They never see text or sample
anything. STOP ends them.

    LeaderRunner(model, max_len)   rank 0's kv-stage runner: announces every prefill and decode
    leader_engine(model, tok, ...) rank 0's serving engine (scheduler, paged pool): announces every step
    follow(model)                  every other rank: run what rank 0 announces until it says STOP

An order is a header (op, number of ints, an extra int) and then the ints, two broadcasts from rank 0:
a prompt's token ids, a sampled token, or an engine step packed whole (token ids, positions, the block
tables, which rows need logits, and the copy-on-write copies the scheduler made since the last step, which
every rank must make in its own pool too).
If rank 0 fails, the followers' next broadcast times out (the process group's timeout), so nothing hangs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.runner import ModelRunner
from ..kv import BlockPool
from ..kv.manager import KVCacheManager
from ..stages import KVCacheRunner

STOP, PREFILL, DECODE, ENGINE, STEP = 0, 1, 2, 3, 4


def announce(op: int, ids: list[int] = (), max_len: int = 0) -> None:
    """Rank 0: tell every rank what the next forward pass is."""
    dist.broadcast(torch.tensor([op, len(ids), max_len], dtype=torch.int64), 0)
    if len(ids):
        dist.broadcast(torch.tensor(ids, dtype=torch.int64), 0)


def pack_step(ids, positions, tables, q_lens, k_lens, logit_rows, n_layers, copies) -> list[int]:
    """One engine step as a flat list of ints (unpack_step reverses it)."""
    counts = [len(ids), len(tables), len(logit_rows), len(copies), -1 if n_layers is None else n_layers]
    return (counts + list(ids) + list(positions) + list(q_lens) + list(k_lens) + list(logit_rows)
            + [len(t) for t in tables] + [b for t in tables for b in t] + [x for c in copies for x in c])


def unpack_step(flat: list[int]) -> tuple:
    """pack_step's list -> (ids, positions, tables, q_lens, k_lens, logit_rows, n_layers, copies)."""
    n, r, m, c, n_layers = flat[:5]
    at = 5

    def take(k):
        nonlocal at
        at += k
        return flat[at - k:at]
    ids, positions, q_lens, k_lens, logit_rows, widths = take(n), take(n), take(r), take(r), take(m), take(r)
    tables = [take(w) for w in widths]
    copies = [tuple(take(3)) for _ in range(c)]
    return ids, positions, tables, q_lens, k_lens, logit_rows, (None if n_layers < 0 else n_layers), copies


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


class LeaderModelRunner(ModelRunner):
    """The engine's runner on rank 0 of a tensor-parallel model: each step is announced first."""
    needs_kv_copies = True      # the engine's pool logs its copy-on-write copies for the other ranks

    def forward_tables(self, ids, positions, tables, q_lens, k_lens, logit_rows, n_layers=None) -> torch.Tensor:
        copies, self.pool.copy_log[:] = list(self.pool.copy_log), []
        announce(STEP, pack_step(ids, positions, tables, q_lens, k_lens, logit_rows, n_layers, copies))
        return super().forward_tables(ids, positions, tables, q_lens, k_lens, logit_rows, n_layers)


def leader_engine(model, tokenizer, **options):
    """Rank 0's LLMEngine for a tensor-parallel model: it schedules, samples and detokenizes alone; every
    step's forward pass is announced to the other ranks, whose pools (same blocks, their heads) follow."""
    from ..engine import LLMEngine

    if options.get("kv_cache_dtype"):
        raise ValueError("a tensor-parallel engine keeps its KV cache in the model's dtype; drop kv_cache_dtype")
    engine = LLMEngine(model, tokenizer, attention="torch", runner_cls=LeaderModelRunner, **options)
    announce(ENGINE, [engine.pool.num_blocks, engine.pool.block_size])
    return engine


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
        elif op == DECODE and isinstance(runner, KVCacheRunner):
            runner.decode_batch(ids.tolist())
        elif op == ENGINE:                                          # an engine: a pool like rank 0's
            num_blocks, block_size = ids.tolist()
            pool = BlockPool(model.cfg, num_blocks, block_size, model.dtype, model.device)
            runner = ModelRunner(model, KVCacheManager(pool), "torch")
        elif op == STEP and isinstance(runner, ModelRunner):
            *step, copies = unpack_step(ids.tolist())
            runner.kv.copy_blocks(copies)
            with torch.inference_mode():
                runner.forward_tables(*step)
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: order {op} makes no sense here (no prompt yet?)")
        passes += op != ENGINE
