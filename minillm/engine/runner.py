"""The model runner: one forward pass per step for everything the scheduler picked.

The new tokens of all scheduled requests are packed into **one flat sequence** — no
padding to the longest request, no loop of forward passes:

    ids        (N,)   the tokens to compute: a whole prompt chunk for some requests, one token for others
    positions  (N,)   each token's position in its own request (RoPE)
    slots      (N,)   where each token's K/V goes in the pool: page * block_size + offset
    q_lens, k_lens    per request: new tokens, and keys it attends to (cached + new)
    block tables      per request: its pages

The model sees a batch of one sequence of N tokens. Its linear layers do not care which
request a token belongs to; only attention does, and it gets the per-request lengths and
block tables from the runner: the Triton kernel (`flash_attn_varlen` with a block table) on a
GPU, gathered pages + SDPA in PyTorch on a CPU (`attention/paged_torch.py`).
Only the last token of a request that reached the end of its tokens gets logits, and each of a
request's speculative tokens (`req.spec_token_ids`: drafts after its sampled token), whose logits
the verification needs. `draft_step` runs a layer-skipping draft: one token per request, the first
n_layers layers only, K/V written to the same pool.
"""
from __future__ import annotations

import torch

from ..attention.paged_torch import paged_attention, plan_paged_attention, workspace_for
from ..kv import BlockPool
from ..triton_support import require_triton
from .scheduler import ScheduledBatch

ATTENTION_BACKENDS = ("torch", "triton")


class _SlotWriter:
    """What the model sees as its `cache`: stores each layer's new K/V at their slots of the pool."""

    def __init__(self, pool: BlockPool, slots: torch.Tensor):
        self.pool, self.slots = pool, slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: (1, n_kv, N, hd) -> the layer's whole pool (num_blocks, block_size, n_kv, hd)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slots, k[0].transpose(0, 1))   # (slots, n_kv, hd)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slots, v[0].transpose(0, 1))   # (QuantizedKV: quantized)
        return kc, vc


class ModelRunner:
    def __init__(self, model, pool: BlockPool, attention: str = "auto"):
        if attention == "auto":
            attention = "triton" if pool.k.is_cuda else "torch"
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be 'auto' or one of {ATTENTION_BACKENDS}; got {attention!r}")
        if attention == "triton":
            require_triton("the engine's triton attention backend")
        self.model, self.pool, self.attention = model, pool, attention
        self._workspace = (None, None)   # torch backend: gather buffers kept from step to step

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the step; logits (M, vocab) in batch order: for each request whose tokens are now all
        computed, its last token's row, or with drafts, 1 + len(drafts) rows (its sampled token, each draft)."""
        ids, positions, q_lens, k_lens = [], [], [], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start, d = req.num_computed_tokens, len(req.spec_token_ids)
            ids += req.token_slice(start, start + n - d) + req.spec_token_ids
            positions += range(start, start + n)
            q_lens.append(n)
            k_lens.append(start + n)
        return self.forward(ids, positions, batch.requests, q_lens, k_lens, batch.logit_rows)

    @torch.inference_mode()
    def draft_step(self, reqs, tokens: list[int], positions: list[int], n_layers: int) -> torch.Tensor:
        """One token per request at the given positions (slots already in their tables), through the
        first n_layers layers: a layer-skipping draft. Logits (len(reqs), vocab)."""
        return self.forward(tokens, positions, reqs, [1] * len(reqs), [p + 1 for p in positions],
                            list(range(len(reqs))), n_layers)

    def forward(self, ids, positions, reqs, q_lens, k_lens, logit_rows, n_layers=None) -> torch.Tensor:
        """ids/positions (N,) packed by request; q_lens[i] tokens of reqs[i] end at key k_lens[i]."""
        tables = [self.pool.tables[r.request_id] for r in reqs]
        return self.forward_tables(ids, positions, tables, q_lens, k_lens, logit_rows, n_layers)

    def forward_tables(self, ids, positions, tables, q_lens, k_lens, logit_rows, n_layers=None) -> torch.Tensor:
        """forward with the requests' block tables given (a tensor-parallel follower has no requests)."""
        dev, bs = self.model.device, self.pool.block_size
        slots = [table[p // bs] * bs + p % bs
                 for table, q, k in zip(tables, q_lens, k_lens) for p in range(k - q, k)]
        attn_fn = self._attention_fn(q_lens, k_lens, tables)
        logits = self.model(torch.tensor([ids], device=dev), torch.tensor(positions, device=dev),
                            cache=_SlotWriter(self.pool, torch.tensor(slots, device=dev)),
                            attn_fn=attn_fn, logit_indices=torch.tensor(logit_rows, device=dev, dtype=torch.long),
                            n_layers=n_layers)
        return logits[0]                                                           # (M, vocab)

    def _attention_fn(self, q_lens, k_lens, tables):
        """The model's attn_fn for this step: q (1, H, N, hd) and the layer's pool -> (1, H, N, hd)."""
        dev = self.model.device
        if self.attention == "torch":
            plan = plan_paged_attention(q_lens, k_lens, tables, self.pool.block_size, dev)
            self._workspace = tuple(workspace_for(plan, self.pool.k[0], w) for w in self._workspace)
            plan.workspace = self._workspace
            return lambda q, k, v, mask=None: paged_attention(q[0].transpose(0, 1), k, v, plan).transpose(0, 1)[None]
        from ..attention.triton_flash import flash_attn_varlen

        cu_q = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + k_lens, device=dev).cumsum(0).to(torch.int32)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        max_q, max_k = max(q_lens), max(k_lens)
        return lambda q, k, v, mask=None: flash_attn_varlen(
            q[0].transpose(0, 1), k, v, cu_q, cu_k, max_q, max_k, causal=True, block_table=table).transpose(0, 1)[None]
