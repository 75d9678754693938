"""One layer of a busy decode step over a paged KV cache, for timing the CPU's paged attention (notebook 14,
`benchmarks/paged_attention_cpu.py`): SmolLM2's 9 query and 3 KV heads of 64, pages of 16 tokens shuffled
over a pool, each request's context drawn around a mean; a float64 reference; and the two plans the
engine's CPU backends would run on it (pages gathered for SDPA, and read in place by the C kernel)."""
from __future__ import annotations

import torch

from ..attention import cpu_kernel
from ..attention.paged_torch import PagedPlan, plan_paged_attention, workspace_for

H, H_KV, D, BLOCK = 9, 3, 64, 16


def make_case(n: int, context: int, pool_blocks: int, seed: int = 0):
    """n requests of context ± 20% keys in a pool of at least pool_blocks pages ->
    q (n, H, D), pool_k, pool_v (blocks, BLOCK, H_KV, D), k_lens, tables (page 0 is never used)."""
    g = torch.Generator().manual_seed(seed)
    k_lens = [context - context // 5 + int(torch.randint(0, 2 * (context // 5) + 1, (1,), generator=g)) for _ in range(n)]
    need = [-(-k // BLOCK) for k in k_lens]
    num_blocks = max(pool_blocks, sum(need) + 1)
    pool_k = torch.randn(num_blocks, BLOCK, H_KV, D, generator=g)
    pool_v = torch.randn(num_blocks, BLOCK, H_KV, D, generator=g)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()     # pages scattered over the pool
    tables, at = [], 0
    for w in need:
        tables.append(order[at:at + w])
        at += w
    q = torch.randn(n, H, D, generator=g)
    return q, pool_k, pool_v, k_lens, tables


def reference(q, pool_k, pool_v, k_lens, tables) -> torch.Tensor:
    """float64, one request at a time: (n, H, D)."""
    out = []
    for i, (k_len, table) in enumerate(zip(k_lens, tables)):
        k = pool_k[table].flatten(0, 1)[:k_len].double().repeat_interleave(H // H_KV, 1)   # (S, H, D)
        v = pool_v[table].flatten(0, 1)[:k_len].double().repeat_interleave(H // H_KV, 1)
        p = torch.einsum("hd,shd->hs", q[i].double(), k).mul(D ** -0.5).softmax(-1)          # (H, S)
        out.append(torch.einsum("hs,shd->hd", p, v))
    return torch.stack(out)                                                                  # (n, H, D)


def decode_plans(k_lens, tables, pool_k, pool_v) -> dict[str, PagedPlan]:
    """The step's plan for each CPU backend: "gather + SDPA" (with its reused gather buffers) and, where
    the kernel builds, "C kernel" (in place)."""
    n = len(k_lens)
    gather = plan_paged_attention([1] * n, k_lens, tables, BLOCK, "cpu")
    gather.workspace = (workspace_for(gather, pool_k, None), workspace_for(gather, pool_v, None))
    plans = {"gather + SDPA": gather}
    if cpu_kernel.available():
        plans["C kernel"] = plan_paged_attention([1] * n, k_lens, tables, BLOCK, "cpu", in_place=True)
    return plans
