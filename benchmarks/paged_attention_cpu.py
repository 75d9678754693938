"""Decode attention over a paged KV cache on a CPU: gather + SDPA against three ways of reading the pages
in place.

The torch backend (`minillm/attention/paged_torch.py`) copies each request's pages into a contiguous
workspace, then calls SDPA. The copy is pure overhead, so this measures what reading in place buys, per
layer, at the shapes of a busy decode step (SmolLM2's 9 query and 3 KV heads of 64, pages of 16 tokens,
shuffled over the pool):

    gather + SDPA        the torch backend, and its two parts timed apart (the gather alone; SDPA on
                         already gathered keys), which bounds what skipping the copy can save
    C kernel             the cpu backend (`cpu_paged.c`, built on this machine): one task per request and
                         KV head, its pages read through the block table, the softmax kept online
    compiled gather      one function that indexes the pool through the block table and attends,
                         compiled by inductor into loops that read the pages where they lie
    FlexAttention        `flex_attention` with a paged block mask (each request's pages as its KV
                         blocks, the last one partial), compiled for the CPU

Each case runs in pools of several sizes (the pages the requests use, the engine's default 1 GiB in float32,
and a bigger one): a step reads the same pages in each, but a variant whose cost follows the pool's size
shows it. Every variant is first checked against a float64 reference of the same case; one that disagrees is
reported, not timed; the first call's time (compiling, or loading from inductor's cache) is kept apart. The
variants take turns round by round; medians per layer. What this does not count: the engine would have to
build FlexAttention's block mask every step, and a compiled variant sees new shapes as the batch changes.

    python benchmarks/paged_attention_cpu.py [--rounds 5] > benchmarks/results/cpu_paged_attention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from minillm.attention.paged_torch import gather_pages, paged_attention
from minillm.course.bench import machine_info, provenance
from minillm.course.paged_case import BLOCK, D, H, H_KV, decode_plans, make_case, reference

CASES = [(64, 200), (16, 1000)]          # (requests, mean context): a busy step, and fewer longer ones


def gather_attend(q, pool_k, pool_v, table, lens):
    """q (n, H, D); pools (blocks, BLOCK, H_kv, D); table (n, W) pages; lens (n,) -> (n, H, D)."""
    n = q.shape[0]
    pos = torch.arange(table.shape[1] * BLOCK)                                  # (S,) logical key positions
    slot = table[:, pos // BLOCK] * BLOCK + pos % BLOCK                         # (n, S) where each key lies
    k = pool_k.flatten(0, 1)[slot]                                              # (n, S, H_kv, D)
    v = pool_v.flatten(0, 1)[slot]
    qg = q.view(n, H_KV, H // H_KV, D)                                          # (n, H_kv, group, D)
    s = torch.einsum("nkgd,nskd->nkgs", qg, k) * D ** -0.5
    s = s.masked_fill((pos[None] >= lens[:, None])[:, None, None], float("-inf"))
    return torch.einsum("nkgs,nskd->nkgd", s.softmax(-1), v).reshape(n, H, D)


def paged_block_mask(k_lens, tables, num_blocks) -> BlockMask:
    """Query b (one token) sees its pages: all but the last whole, the last up to its length."""
    n = len(k_lens)
    need = torch.tensor([len(t) for t in tables])
    rem = torch.tensor(k_lens) - (need - 1) * BLOCK                             # keys on the last page
    last = torch.tensor([t[-1] for t in tables])
    partial = (rem < BLOCK).int()
    full_idx = torch.zeros(n, 1, 1, num_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        full_idx[i, 0, 0, :len(t)] = torch.tensor(t, dtype=torch.int32)
    part_idx = torch.zeros(n, 1, 1, num_blocks, dtype=torch.int32)
    part_idx[:, 0, 0, 0] = last.int()

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // BLOCK != last[b]) | (kv_idx % BLOCK < rem[b])
    return BlockMask.from_kv_blocks(partial.view(n, 1, 1), part_idx, (need - partial).int().view(n, 1, 1), full_idx,
                                    BLOCK_SIZE=(1, BLOCK), mask_mod=mask_mod, seq_lengths=(1, num_blocks * BLOCK))


def median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_case(n: int, context: int, pool_blocks: int, rounds: int) -> dict:
    q, pk, pv, k_lens, tables = make_case(n, context, pool_blocks)
    ref = reference(q, pk, pv, k_lens, tables)
    plans = decode_plans(k_lens, tables, pk, pv)
    plan = plans["gather + SDPA"]
    page = pk[0].numel()

    def gathers():
        for g in plan.groups:
            span = slice(g.offset * page, (g.offset + g.pages.numel()) * page)
            gather_pages(pk, g.pages, g.rows.numel(), plan.workspace[0][span])
            gather_pages(pv, g.pages, g.rows.numel(), plan.workspace[1][span])
    gathered = [(q[g.rows][:, :, None], gather_pages(pk, g.pages, g.rows.numel()),
                 gather_pages(pv, g.pages, g.rows.numel()), g.mask) for g in plan.groups]

    def sdpa_only():
        for qd, kd, vd, m in gathered:
            F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m, enable_gqa=True)

    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(k_lens)
    compiled = torch.compile(gather_attend, dynamic=False)
    mask = paged_block_mask(k_lens, tables, pk.shape[0])
    kp, vp = (p.flatten(0, 1)[None].transpose(1, 2).expand(n, -1, -1, -1) for p in (pk, pv))   # (n, H_kv, keys, D)
    flex = torch.compile(flex_attention, dynamic=False)
    variants = {name: (lambda p=p: paged_attention(q, pk, pv, p)) for name, p in plans.items()} | {
        "compiled gather": lambda: compiled(q, pk, pv, table, lens),
        "FlexAttention": lambda: flex(q[:, :, None], kp, vp, block_mask=mask, enable_gqa=True)[:, :, 0],
    }
    result = {"requests": n, "mean_context": statistics.mean(k_lens), "pool_blocks": pk.shape[0], "variants": {}}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        out = fn()                                                           # compiles, for the compiled ones
        first = time.perf_counter() - t0
        err = (out.double() - ref).abs().max().item()
        result["variants"][name] = {"max_error": err, "first_call_s": first, "correct": err < 1e-4, "runs_ms": []}
    parts = {"gather_only_ms": gathers, "sdpa_only_ms": sdpa_only}     # the engine's path, in two
    split = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in variants.items():
            if result["variants"][name]["correct"]:
                result["variants"][name]["runs_ms"].append(median_ms(fn))
        for name, fn in parts.items():
            split[name].append(median_ms(fn))
    for v in result["variants"].values():
        v["median_ms"] = statistics.median(v["runs_ms"]) if v["runs_ms"] else None
    result["variants"]["gather + SDPA"].update({k: statistics.median(v) for k, v in split.items()})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool-blocks", type=int, nargs="+", default=[0, 1456, 4096],
                    help="pages in the pool (0: just those the requests use; 1,456: the engine's default 1 GiB "
                         "in float32)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = []
    for (n, context), pool in ((c, p) for c in CASES for p in args.pool_blocks):
        cases.append(run_case(n, context, pool, args.rounds))
        print(f"{n} requests x ~{context}, {cases[-1]['pool_blocks']} pages: " + ", ".join(f"{k} {v['median_ms'] or float('nan'):.2f} ms"
                                                         for k, v in cases[-1]["variants"].items()), file=sys.stderr)
    print(json.dumps({"machine": machine_info(), **provenance(), "heads": [H, H_KV, D], "block_size": BLOCK, "rounds": args.rounds,
                      "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
