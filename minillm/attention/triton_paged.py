"""Stage 4 kernels: attention over a paged KV cache (PagedAttention).

The cache is a pool of pages, (num_blocks, block_size, H_kv, D) per layer, and each sequence has
a block table: its logical block i lives in physical block table[i]. Two things change against
the contiguous stage, and only these:

- writing: each new token's K and V go to their *slot* (physical block * block_size + offset),
  given by the slot mapping the block pool hands out (`write_kv_to_slots`, a Triton kernel);
- reading: the attention kernels look up the page of every key tile in the block table before
  loading it (`PAGED` branches in triton_flash.py: `decode_attention(..., block_table=...)` for
  decode, `flash_attn_varlen(..., block_table=...)` for new tokens over a cached prefix).

`paged_decode_reference` is the readable version: gather the pages into a contiguous tensor and
call the naive attention.
"""
from __future__ import annotations

import torch

from ..triton_support import require_triton

require_triton("stage 4 (the paged attention kernels)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .naive import naive_attention
from .triton_flash import _check, decode_attention, flash_attn_varlen  # noqa: F401  (re-exported)


@triton.jit
def _write_slots_kernel(K_new, V_new, K_cache, V_cache, slots, s_new_t, s_new_v, s_cache_t,
                        ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per new token: copy its H_kv x D keys and values (2 x ROW x e bytes read and
    # written) into its slot. The slot, not the position, says where: pages need not be adjacent.
    # A slot of -1 is a padding row (a captured graph's batch is padded up to its size): nothing is written.
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    offs = tl.arange(0, BLOCK)
    ok = offs < tl.where(slot >= 0, ROW, 0)
    tl.store(K_cache + slot * s_cache_t + offs, tl.load(K_new + t * s_new_t + offs, mask=ok), mask=ok)
    tl.store(V_cache + slot * s_cache_t + offs, tl.load(V_new + t * s_new_v + offs, mask=ok), mask=ok)


def write_kv_to_slots(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: (n, H_kv, D) new keys/values; caches: (num_blocks, block_size, H_kv, D); slot_mapping: (n,),
    where a slot of -1 writes nothing."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    n, H_kv, D = k.shape
    if not (k[0].is_contiguous() and v[0].is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("each token's (H_kv, D) block and the caches must be contiguous")
    if n == 0:
        return
    row = H_kv * D
    _write_slots_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), row,
                              ROW=row, BLOCK=triton.next_power_of_2(row))


def paged_decode_reference(q, k_cache, v_cache, cache_seqlens, block_table) -> torch.Tensor:
    """The same result as decode_attention(..., block_table=...), by gathering pages: (B, H, D)."""
    B, H, D = q.shape
    bs = k_cache.shape[1]
    outs = []
    for b in range(B):
        n = int(cache_seqlens[b])
        pages = block_table[b, : -(-n // bs)].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]   # (n, H_kv, D), contiguous again
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        outs.append(naive_attention(q[b][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0, :, 0])
    return torch.stack(outs)
