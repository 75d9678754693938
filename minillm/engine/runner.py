"""The model runner: one forward pass per step for everything the scheduler picked.

It holds what the paged stage's runner (`stages.PagedRunner`, stage 4) holds, one `PagedForward`
(`paged_forward.py`), and is driven by a scheduler: the new tokens of all scheduled requests are packed
into **one flat sequence**, no padding to the longest request, and attention reads each request's pages
through its block table (`attention/paged.py`):

    ids        (N,)   the tokens to compute: a whole prompt chunk for some requests, one token for others
    positions  (N,)   each token's position in its own request (RoPE)
    q_lens, k_lens    per request: new tokens, and keys it attends to (cached + new)
    block tables      per request: its pages

The scheduler has already made room in the pool (the KV-cache manager), so the runner only reads
the tables. Only the last token of a request that reached the end of its tokens gets logits, and each
of a request's speculative tokens (`req.spec_token_ids`: drafts after its sampled token), whose logits
the verification needs (`ScheduledBatch.logit_rows`). `draft_step` runs a layer-skipping draft: one
token per request, the first n_layers layers only, K/V written to the same pool.
"""
from __future__ import annotations

import torch

from ..cuda_graphs import DecodeGraphs
from ..kv.manager import KVCacheManager
from ..kv.quantized import QuantizedKV
from ..paged_forward import Packed, PagedForward, pack
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, kv: KVCacheManager, attention: str = "auto"):
        self.paged = PagedForward(model, kv, attention)
        self.model, self.kv, self.attention = model, kv, self.paged.attention
        self.graphs: DecodeGraphs | None = None

    @property
    def pool(self):
        return self.kv.pool

    def use_decode_graphs(self, max_batch: int, max_len: int, eager: bool = False) -> None:
        """Run decode-only steps of up to max_batch requests through `DecodeGraphs`: captured CUDA graphs
        on a GPU, or (eager, or on a CPU) the same static step uncaptured. Needs the Triton kernels and a
        float KV cache."""
        if not self.paged.backend.captures or isinstance(self.kv.pool.k[0], QuantizedKV):
            raise ValueError("decode graphs need attention='triton' and a float KV cache (no kv_cache_dtype)")
        self.graphs = DecodeGraphs(self.model, self.kv.pool, max_batch, max_len, eager, self.paged.backend)

    def _graph_batch(self, batch: ScheduledBatch) -> bool:
        """Whether the step is one the graphs run: every request decodes one token, no drafts."""
        return (self.graphs is not None and len(batch.requests) <= self.graphs.sizes[-1]
                and all(n == 1 for n in batch.num_new_tokens) and not any(r.spec_token_ids for r in batch.requests)
                and batch.logit_rows == list(range(len(batch.requests))))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the step; logits (M, vocab) in batch order: for each request whose tokens are now all
        computed, its last token's row, or with drafts, 1 + len(drafts) rows (its sampled token, each draft)."""
        step = pack((req.num_computed_tokens,
                     req.token_slice(req.num_computed_tokens, req.num_computed_tokens + n - len(req.spec_token_ids))
                     + req.spec_token_ids) for req, n in zip(batch.requests, batch.num_new_tokens))
        tables = [self.kv.block_table(r) for r in batch.requests]
        if self._graph_batch(batch):
            return self.graphs.run(step.ids, step.positions, tables)
        return self.forward_tables(step.ids, step.positions, tables, step.q_lens, step.k_lens, batch.logit_rows)

    @torch.inference_mode()
    def draft_step(self, reqs, tokens: list[int], positions: list[int], n_layers: int) -> torch.Tensor:
        """One token per request at the given positions (slots already in their tables), through the
        first n_layers layers: a layer-skipping draft. Logits (len(reqs), vocab)."""
        step = pack((p, [t]) for p, t in zip(positions, tokens))
        return self.forward_tables(step.ids, step.positions, [self.kv.block_table(r) for r in reqs], step.q_lens,
                                   step.k_lens, list(range(len(reqs))), n_layers)

    def forward_tables(self, ids, positions, tables, q_lens, k_lens, logit_rows, n_layers=None) -> torch.Tensor:
        """ids/positions (N,) packed by request; q_lens[i] tokens of the request whose pages are tables[i] end
        at key k_lens[i]. Logits (M, vocab) of the rows logit_rows (M,). (One call: a tensor-parallel leader
        announces it to the other ranks first, `distributed/leader.py`.)"""
        return self.paged(Packed(ids, positions, q_lens, k_lens), tables, logit_rows, n_layers)
