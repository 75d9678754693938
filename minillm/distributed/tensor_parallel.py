"""Tensor parallelism: every matrix of the model split across `world` ranks, one all-reduce after each
half of a block (Megatron-LM's layout).

    wqkv      (H + 2 n_kv) hd x d   split by output rows: rank r keeps its H/world query heads and its
                                    n_kv/world KV heads, so a GQA group never straddles two ranks
    wo        d x H hd              split by input columns (the rank's heads) -> partial sums -> all-reduce
    w_gate_up 2 ffn x d             split by output rows: the rank's slice of gate and the same of up
    w_down    d x ffn               split by input columns -> partial sums -> all-reduce
    embedding vocab x d             split by vocabulary: a rank looks up the ids it owns, zeros elsewhere,
                                    all-reduce; the tied head gives each rank its vocabulary's logits,
                                    all-gathered into the whole row

Norms, RoPE and the residual stream are replicated: every rank holds the same (B, T, d) activations
between blocks. Each rank's KV cache holds only its KV heads: `model.cfg` becomes the rank's share
(n_heads / world, n_kv_heads / world), so every cache built from it has the right shape.

The sizes must divide: SmolLM2-135M has 9 query heads, 3 KV heads, an FFN of 1,536 and a vocabulary of
49,152, so world sizes 1 and 3 work and 2 is refused with a message (padding heads would work too, at the
cost of computing empty heads; refusing keeps every rank's work real).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def check_tensor_parallel(cfg, world: int) -> None:
    """Raise ValueError saying which size does not divide, and which world sizes would."""
    if getattr(cfg, "qkv_bias", False) or getattr(cfg, "qk_norm", False):
        raise ValueError("tensor parallelism splits Llama's attention; this model's QKV bias or q/k norms are not "
                         "split: run it on one rank")
    sizes = {"query heads": cfg.n_heads, "KV heads": cfg.n_kv_heads, "FFN width": cfg.ffn_dim,
             "vocabulary": cfg.vocab_size}
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % world]
    if world < 1 or bad:
        fits = [w for w in range(1, cfg.n_kv_heads + 1) if all(n % w == 0 for n in sizes.values())]
        raise ValueError(f"tensor parallel size {world} does not divide the model's {', '.join(bad) or 'ranks'}: "
                         f"each rank must own whole heads. For {cfg.name} use one of {fits}")


class RowParallelLinear(nn.Module):
    """y = x_r @ W_r^T summed over ranks: this rank's input columns, then an all-reduce."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # (out, in / world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)                              # (..., out) this rank's partial sum
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """The rows of the vocabulary [start, start + n) on this rank; every id found on exactly one rank."""

    def __init__(self, weight: torch.Tensor, start: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # (vocab / world, d)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])       # (B, T)
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        dist.all_reduce(x)                                         # (B, T, d): each id's row from its owner
        return x


class VocabParallelHead(nn.Module):
    """Tied output head: this rank's vocabulary's logits, all-gathered into the whole row."""

    def __init__(self, embedding: VocabParallelEmbedding, world: int):
        super().__init__()
        self.embedding, self.world = embedding, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.embedding.weight).contiguous()   # (B, T, vocab / world)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)                           # (B, T, vocab), in vocabulary order


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start:start + n].clone()


def qkv_rows(cfg, rank: int, world: int) -> torch.Tensor:
    """Indices of the fused QKV weight's rows that `rank` keeps: its query heads, then its KV heads' K and V
    rows (the layout is q heads | k heads | v heads, head_dim rows each)."""
    H, n_kv, hd = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.head_dim
    q = torch.arange(rank * H * hd, (rank + 1) * H * hd)
    k = cfg.n_heads * hd + torch.arange(rank * n_kv * hd, (rank + 1) * n_kv * hd)
    return torch.cat([q, k, k + cfg.n_kv_heads * hd])                  # ((H + 2 n_kv) hd,)


@torch.no_grad()
def shard_model(model, rank: int, world: int):
    """Keep this rank's share of every matrix (in place) and make model.cfg the rank's share; returns model.
    Needs an initialised process group of `world` ranks (any backend) and an unquantized model."""
    cfg = model.cfg
    check_tensor_parallel(cfg, world)
    if model.quant:
        raise ValueError("tensor parallelism splits float weights; load the model without quant=")
    H, n_kv, hd, ffn = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.head_dim, cfg.ffn_dim // world
    for block in model.layers:
        a, m = block.attn, block.mlp
        rows = a.wqkv.weight[qkv_rows(cfg, rank, world)]             # (q | k | v heads) x hd rows: a copy
        a.wqkv = nn.Linear(cfg.d_model, (H + 2 * n_kv) * hd, bias=False)
        a.wqkv.weight = nn.Parameter(rows, requires_grad=False)
        a.wo = RowParallelLinear(a.wo.weight[:, rank * H * hd:(rank + 1) * H * hd].clone())
        a.n_heads, a.n_kv = H, n_kv
        g = m.w_gate_up.weight                                     # (gate | up) rows
        gate, up = _rows(g, rank * ffn, ffn), _rows(g, cfg.ffn_dim + rank * ffn, ffn)
        m.w_gate_up = nn.Linear(cfg.d_model, 2 * ffn, bias=False)
        m.w_gate_up.weight = nn.Parameter(torch.cat([gate, up]), requires_grad=False)
        m.w_down = RowParallelLinear(m.w_down.weight[:, rank * ffn:(rank + 1) * ffn].clone())
    if not cfg.tie_embeddings:
        raise ValueError("only tied embeddings are split here (SmolLM2's); an untied head would split the same way")
    vocab = cfg.vocab_size // world
    model.tok_emb = VocabParallelEmbedding(_rows(model.tok_emb.weight, rank * vocab, vocab), rank * vocab)
    model.lm_head = VocabParallelHead(model.tok_emb, world)
    model.cfg = dataclasses.replace(cfg, n_heads=H, n_kv_heads=n_kv)   # the shape this rank holds: caches follow
    return model
