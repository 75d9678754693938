"""Paged attention in plain PyTorch: the serving engine's attention on a CPU.

The contract is `flash_attn_varlen(..., block_table=...)`'s: the new tokens of several
requests packed into one sequence of queries, each request's keys and values in pages of
the pool, found through its block table. On a GPU the Triton kernel reads the pages in
place. Here, at native CPU speed, a request's pages are first gathered into a contiguous
tensor (one copy of its K/V) and handed to `F.scaled_dot_product_attention`:

    decodes (one query each)       gathered together, padded to the longest, one SDPA call
                                   with a mask that hides each row's padding; requests of very
                                   different lengths go in separate groups (padding a 100-token
                                   request to 1,500 would copy and read 15x its keys)
    prefill chunks (many queries)  one SDPA call each, causal, bottom-right aligned
                                   (the chunk's queries are the last of its keys)

Which requests are which, and what to gather, is the same in every layer: `plan_paged_attention`
works it out once per step, and `paged_attention` runs it 30 times. `TorchPaged` is this file as the
"torch" paged-attention backend (`attention/paged.py`): plan, write, attend, and the gather buffers it
keeps from step to step.

With `in_place` (the "cpu" backend) the decodes skip the gather: the C kernel of `cpu_paged.c` reads
their pages where they are, through a block table, the way the Triton decode kernel does on a GPU. So do
chunks of at most IN_PLACE_QUERIES queries (a speculative step's sampled token and its drafts, a prompt's
short last chunk), each query as a decode of its own that sees the keys up to its own position. A chunk
gathered for SDPA costs a copy of its whole context and a few Python calls in every layer: at 8 requests of
600 tokens with 5 queries each, the gathers took 2.8x the kernel's time (2.0x at 16 queries; AVX-512 EPYC).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv.quantized import QuantizedKV
from .sdpa import sdpa_attention


PADDING_SLACK = 1.25   # a decode group pads to its longest member: at most 25% more keys than it has
IN_PLACE_QUERIES = 16  # in place: chunks of up to this many queries go to the C kernel, one decode per query


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor                    # (n,) query rows of these decodes
    pages: torch.Tensor                   # (n * W,) their pages, each padded to W with page 0
    mask: torch.Tensor                    # (n, 1, 1, W * block_size): key j exists for row i
    offset: int                           # first page of this group in the gather workspace


@dataclass(slots=True)
class PagedPlan:
    groups: list[DecodeGroup]
    chunks: list[tuple[int, int, torch.Tensor, int]]   # (first query row, queries, pages, keys)
    num_pages: int                        # pages the decode groups gather, in all
    workspace: tuple | None = None        # (K, V) flat gather buffers, reused by every layer
    in_place: tuple | None = None         # queries for the C kernel: rows (n,), table (n, W) int32, lens (n,) int32


def plan_paged_attention(q_lens: list[int], k_lens: list[int], tables: list[list[int]],
                         block_size: int, device, in_place: bool = False) -> PagedPlan:
    """q_lens[i] new queries of request i attend to its first k_lens[i] keys, stored in pages tables[i].
    in_place: the decodes, and the chunks of up to IN_PLACE_QUERIES queries, are read where they are by the C
    kernel (no groups, no gather): query t of a chunk of n is a decode of the first k_len - n + t + 1 keys."""
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    need = [-(-k // block_size) for k in k_lens]                                      # pages per request
    chunks = [(starts[i], q_lens[i], torch.tensor(tables[i][:need[i]], device=device), k_lens[i])
              for i, n in enumerate(q_lens) if n > 1]
    if in_place:
        chunks = [c for c in chunks if c[1] > IN_PLACE_QUERIES]
        own = [(starts[i] + t, i, k_lens[i] - n + t + 1)                     # (query row, request, keys)
               for i, n in enumerate(q_lens) if n <= IN_PLACE_QUERIES for t in range(n)]
        width = max((need[i] for _, i, _ in own), default=0)
        table = torch.tensor([tables[i][:need[i]] + [0] * (width - need[i]) for _, i, _ in own], dtype=torch.int32)
        queries = (torch.tensor([row for row, _, _ in own]), table.view(len(own), width),
                   torch.tensor([keys for _, _, keys in own], dtype=torch.int32))
        return PagedPlan([], chunks, 0, in_place=queries if own else None)
    dec = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: -need[i])
    buckets, current, total = [], [], 0
    for i in dec:                           # longest first; a new group when padding would pass the slack
        if current and need[current[0]] * (len(current) + 1) > PADDING_SLACK * (total + need[i]):
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += need[i]
    if current:
        buckets.append(current)
    groups, offset = [], 0
    for b in buckets:
        width = need[b[0]]
        pages = [p for i in b for p in tables[i][:need[i]] + [0] * (width - need[i])]
        lens = torch.tensor([k_lens[i] for i in b], device=device)
        mask = (torch.arange(width * block_size, device=device) < lens[:, None])[:, None, None, :]
        groups.append(DecodeGroup(torch.tensor([starts[i] for i in b], device=device),
                                  torch.tensor(pages, device=device), mask, offset))
        offset += len(pages)
    return PagedPlan(groups, chunks, offset)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache (num_blocks, block_size, H_kv, D), pages (rows * W,) -> (rows, H_kv, W * block_size, D).

    One copy of the pages (index_select moves whole pages). With `out` (a slice of a workspace) the
    copy lands in memory reused from layer to layer and step to step: a fresh 10 MB tensor every
    layer would cost its page faults every time."""
    if isinstance(cache, QuantizedKV):                                 # pages of codes -> values
        x = cache.index_select(0, pages).dequantize()                  # (rows * W, bs, H_kv, D)
        return x.view(rows, -1, *x.shape[2:]).transpose(1, 2)
    shape = (pages.numel(), *cache.shape[1:])
    if out is None:
        x = cache.index_select(0, pages)                               # (rows * W, bs, H_kv, D)
    else:
        x = torch.index_select(cache, 0, pages, out=out.view(shape))
    x = x.view(rows, -1, *cache.shape[2:])                             # (rows, W * bs, H_kv, D)
    return x.transpose(1, 2)                                           # (rows, H_kv, W * bs, D)


def workspace_for(plan: PagedPlan, cache: torch.Tensor, workspace: torch.Tensor | None) -> torch.Tensor:
    """A flat buffer big enough for this step's decode gathers (the old one if it is)."""
    if isinstance(cache, QuantizedKV):
        return None                                                    # dequantizing makes a new tensor anyway
    need = plan.num_pages * cache[0].numel()
    if workspace is None or workspace.numel() < need or workspace.dtype != cache.dtype:
        workspace = cache.new_empty(int(need * 1.25) + 1)              # room to grow a little
    return workspace


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedPlan) -> torch.Tensor:
    """q (N, H, D) packed queries; k_cache, v_cache (num_blocks, block_size, H_kv, D) -> (N, H, D)."""
    out = torch.empty_like(q)
    if plan.in_place is not None:                                           # decodes: pages read in place
        from . import cpu_kernel

        cpu_kernel.paged_decode(q, k_cache, v_cache, *plan.in_place, out)
    page = k_cache[0].numel()
    for g in plan.groups:
        n = g.rows.numel()
        span = slice(g.offset * page, (g.offset + g.pages.numel()) * page)
        kw, vw = (None, None) if plan.workspace is None else (w if w is None else w[span] for w in plan.workspace)
        qd = q[g.rows][:, :, None]                                          # (n, H, 1, D)
        kd = gather_pages(k_cache, g.pages, n, kw)                          # (n, H_kv, S, D)
        vd = gather_pages(v_cache, g.pages, n, vw)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, enable_gqa=True)
        out[g.rows] = od[:, :, 0]
    for start, n, pages, k_len in plan.chunks:
        qc = q[start:start + n].transpose(0, 1)[None]                       # (1, H, n, D)
        kc = gather_pages(k_cache, pages, 1)[:, :, :k_len]                  # (1, H_kv, k_len, D)
        vc = gather_pages(v_cache, pages, 1)[:, :, :k_len]
        out[start:start + n] = sdpa_attention(qc, kc, vc)[0].transpose(0, 1)  # causal, bottom-right
    return out


def write_slots(kc, vc, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v (N, n_kv, hd) into their slots (N,) of a layer's pages (num_blocks, block_size, n_kv, hd); a
    QuantizedKV quantizes them as they are written."""
    kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k)               # (slots, n_kv, hd)
    vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v)


class TorchPaged:
    """The "torch" backend: pages gathered for SDPA, into buffers kept from step to step."""

    name = "torch"
    captures = False
    in_place = False                      # decodes read by the C kernel where they are ("cpu", paged_cpu.py)

    def __init__(self):
        self.workspace = (None, None)     # (K, V) flat gather buffers, grown as steps need

    def plan(self, pool, q_lens: list[int], k_lens: list[int], tables: list[list[int]]) -> PagedPlan:
        plan = plan_paged_attention(q_lens, k_lens, tables, pool.block_size, pool.device, self._in_place(pool))
        self.workspace = tuple(workspace_for(plan, pool.k[0], w) for w in self.workspace)
        plan.workspace = self.workspace
        return plan

    def _in_place(self, pool) -> bool:
        return False

    def write(self, kc, vc, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        write_slots(kc, vc, k, v, slots)

    def attend(self, q: torch.Tensor, kc, vc, plan: PagedPlan) -> torch.Tensor:
        """q (N, H, hd) packed queries -> (N, H, hd)."""
        return paged_attention(q, kc, vc, plan)
