"""One forward pass over a paged KV cache: what stage 4 (`stages.PagedRunner`) and stage 5 (the engine's
`engine/runner.py`) both hold. Stage 5 is stage 4 with a scheduler in front, by composition.

Every sequence's new tokens are packed into **one flat sequence**, no padding (`pack`):

    ids, positions    (N,)  the tokens to compute, each at its position in its own sequence (RoPE)
    q_lens, k_lens          per sequence: its new tokens, and the keys it attends to (cached + new)

and `PagedForward` runs the model once over them, attention writing and reading each sequence's pages
through its block table (`attention/paged.py`, with the chosen paged-attention backend, which keeps its
gather buffers from step to step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention.paged import PagedAttention, check_backend, make_backend
from .backends import backend_of


@dataclass
class Packed:
    """A step's tokens, packed: ids and positions (N,), and per sequence q_lens and k_lens."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    k_lens: list[int] = field(default_factory=list)

    def last_rows(self) -> list[int]:
        """The row of each sequence's last new token."""
        ends, n = [], 0
        for q in self.q_lens:
            n += q
            ends.append(n - 1)
        return ends


def pack(chunks) -> Packed:
    """chunks: (start, tokens) per sequence: its new tokens, the first at position `start` -> one flat step."""
    p = Packed()
    for start, tokens in chunks:
        p.ids += tokens
        p.positions += range(start, start + len(tokens))
        p.q_lens.append(len(tokens))
        p.k_lens.append(start + len(tokens))
    return p


class PagedForward:
    def __init__(self, model, kv, attention: str = "auto", what: str = "the triton attention backend"):
        """model; kv: the KV-cache manager whose pool holds the pages; attention: "auto", "cpu", "torch" or
        "triton" (`attention.paged.check_backend`; auto follows the model's backend)."""
        self.model, self.kv = model, kv
        self.attention = check_backend(attention, kv.pool.device.type == "cuda", what,
                                       native=model is not None and backend_of(model) == "native")
        self.backend = make_backend(self.attention)     # its state (gather buffers) kept from step to step

    def __call__(self, step: Packed, tables: list[list[int]], logit_rows: list[int],
                 n_layers: int | None = None) -> torch.Tensor:
        """One pass over the packed step; tables[i]: sequence i's pages. Logits (M, vocab) of logit_rows (M,)."""
        dev = self.model.device
        attn = PagedAttention(self.kv.pool, step.q_lens, step.k_lens, tables, self.backend)
        logits = self.model(torch.tensor([step.ids], device=dev), torch.tensor(step.positions, device=dev), attn,
                            logit_indices=torch.tensor(logit_rows, device=dev, dtype=torch.long), n_layers=n_layers)
        return logits[0]                                                           # (M, vocab)
