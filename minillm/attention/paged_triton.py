"""The "triton" paged-attention backend: the kernels of `triton_paged.py` read pages in place through the
block table (`decode_attention` when every sequence brings one token, else `flash_attn_varlen`), and new
K/V are written to their slots by a kernel. The one backend a CUDA graph can capture: its decode step
reads only fixed buffers (`static_buffers`), refilled before each replay (`fill`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.paged import slot_of
from ..kv.quantized import QuantizedKV
from .paged_torch import write_slots


@dataclass
class TritonPlan:
    table: torch.Tensor                   # (B, W) int32: each sequence's pages, padded with page 0
    k_lens: torch.Tensor                  # (B,) int32: keys per sequence
    decode: bool                          # one query per sequence: the decode kernel
    cu_q: torch.Tensor | None = None      # (B + 1,) int32 cumulative queries (varlen)
    cu_k: torch.Tensor | None = None
    max_q: int = 1
    max_k: int | None = None              # None: read from k_lens (a captured step may not)
    num_splits: int | None = None         # fixed key slices per sequence (a captured step)


class TritonPaged:
    name = "triton"
    captures = True                       # CUDA graphs may record its decode step

    def __init__(self):
        from . import triton_paged            # triton: imported on first use

        self.kernels = triton_paged

    def plan(self, pool, q_lens: list[int], k_lens: list[int], tables: list[list[int]]) -> TritonPlan:
        dev, width = pool.device, max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        return TritonPlan(table, torch.tensor(k_lens, dtype=torch.int32, device=dev), max(q_lens) == 1,
                          torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32),
                          torch.tensor([0] + k_lens, device=dev).cumsum(0).to(torch.int32), max(q_lens), max(k_lens))

    def write(self, kc, vc, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v (N, n_kv, hd) into their slots (N,) of this layer's pages (-1: a padding row, not written)."""
        if isinstance(kc, QuantizedKV):                   # quantized as it is written
            write_slots(kc, vc, k, v, slots)
        else:
            self.kernels.write_kv_to_slots(k.contiguous(), v.contiguous(), kc, vc, slots)

    def attend(self, q: torch.Tensor, kc, vc, plan: TritonPlan) -> torch.Tensor:
        """q (N, H, hd) packed queries -> (N, H, hd)."""
        if plan.decode:
            return self.kernels.decode_attention(q, kc, vc, plan.k_lens, block_table=plan.table,
                                                 max_seqlen_k=plan.max_k, num_splits=plan.num_splits)
        return self.kernels.flash_attn_varlen(q, kc, vc, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                              causal=True, block_table=plan.table)

    # ---------------------------------------------------------------- the hooks CUDA graphs need
    def static_buffers(self, max_batch: int, width: int, device) -> dict[str, torch.Tensor]:
        """What a captured decode step reads besides ids and positions, at fixed addresses: slots (S,) (-1:
        a padding row), k_lens (S,) (0 for padding: its output is 0, never read), table (S, W)."""
        return {"slots": torch.full((max_batch,), -1, dtype=torch.long, device=device),
                "k_lens": torch.zeros(max_batch, dtype=torch.int32, device=device),
                "table": torch.zeros(max_batch, width, dtype=torch.int32, device=device)}

    def static_plan(self, buffers: dict, size: int, num_splits: int) -> tuple[torch.Tensor, TritonPlan]:
        """Prepare for capture: (slots, plan) over the first `size` rows of the buffers, key slices fixed."""
        return buffers["slots"][:size], TritonPlan(buffers["table"][:size], buffers["k_lens"][:size], True,
                                                   num_splits=num_splits)

    def fill(self, buffers: dict, tables: list[list[int]], positions: list[int], size: int, block_size: int) -> None:
        """Prepare for replay: one decode batch (token i at positions[i] of the sequence whose pages are
        tables[i]) into the buffers' first `size` rows, the rows after the batch padding."""
        pad, width = size - len(tables), buffers["table"].shape[1]
        slots = [slot_of(t, p, block_size) for t, p in zip(tables, positions)] + [-1] * pad
        rows = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad, dtype=torch.int32)
        buffers["slots"][:size].copy_(torch.tensor(slots), non_blocking=True)
        buffers["k_lens"][:size].copy_(torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32),
                                       non_blocking=True)
        buffers["table"][:size].copy_(rows, non_blocking=True)
