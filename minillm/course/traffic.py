"""How much memory attention holds and moves: the numbers behind notebook 05, from a model's config.

Per sequence of T tokens, causal, e bytes per value, H query heads and H_kv key/value heads of width D:

    inputs and output       Q and O: H T D e each;  K and V: H_kv T D e each
    score matrix            H T T e, for every layer, if it is ever stored

Traffic between main memory and the chip (the bytes that decide a memory-bound kernel's time):

    naive (stage 1, eager PyTorch)   each operation is a full pass over the H x T x T matrix:
        q @ k^T writes it; / sqrt(d) reads + writes; the causal mask reads + writes; softmax reads +
        writes; probs @ v reads it: 8 passes of H T T e, the masked half included (eager PyTorch does
        not skip it), plus Q, K, V, O and the repeated K/V (repeat_interleave writes H T D e each)
    flash (the Triton prefill kernel)  one program per (query block of BLOCK_M rows, head) reads its Q
        block once, walks the key tiles of BLOCK_N up to the block's last row (causal: the rest are never
        visited), and writes O once. So K and V are read once per query block, per query head:
        H x sum over blocks of keys visited x 2 D e. GQA does not shrink this count: the 3 query heads of
        a group each read the KV head (on a GPU the L2 cache often serves the repeats).
The ratio is about 8 x BLOCK_M / D: larger query blocks mean fewer re-reads of K and V.
"""
from __future__ import annotations

import math

from ..config import ModelConfig

NAIVE_PASSES = 8   # full passes over the T x T matrix in naive_attention (see above)


def attention_sizes(cfg: ModelConfig, T: int, e: int = 4) -> dict:
    """Bytes of Q, K, V, O and of one layer's score matrix, for one sequence of T tokens."""
    q_o = 2 * cfg.n_heads * T * cfg.head_dim * e
    k_v = 2 * cfg.n_kv_heads * T * cfg.head_dim * e
    return {"qkvo": q_o + k_v, "scores": cfg.n_heads * T * T * e}


def attention_traffic(cfg: ModelConfig, T: int, e: int = 2, block_m: int = 64, block_n: int = 64) -> dict:
    """Bytes moved by one layer's causal attention over one sequence of T tokens:
    {"naive": ..., "flash": ..., "ratio": naive / flash}, with the kernel's real tile sizes."""
    H, H_kv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkvo = attention_sizes(cfg, T, e)["qkvo"]
    repeat = 2 * H * T * D * e                                     # repeat_interleave writes K and V per query head
    naive = qkvo + repeat + repeat + NAIVE_PASSES * H * T * T * e   # ... and the product reads them back
    keys_visited = sum(min(T, math.ceil(min(T, (b + 1) * block_m) / block_n) * block_n)
                       for b in range(math.ceil(T / block_m)))      # per query head, over all query blocks
    flash = 2 * H * T * D * e + H * keys_visited * 2 * D * e        # Q in, O out; K and V per block
    return {"naive": naive, "flash": flash, "ratio": naive / flash}
