"""Runners: what changes between stages. A runner turns token ids into next-token logits.

    prefill(ids) -> logits (vocab,)            the prompt, once
    decode(token) -> logits (vocab,)           one new token
    prefill_batch(list of ids) -> (B, vocab)   several prompts of different lengths
    decode_batch(tokens) -> (B, vocab)         one new token for each

The cached runners (kv, flash, paged) also serve speculative decoding (`speculative/`), one sequence:

    length                                     tokens whose K/V are stored
    extend(ids, n_layers=None) -> (T, vocab)   append T tokens; logits at every one of them
    truncate(n)                                forget every token after the first n (rejected drafts)

Stage 1 (`NaiveRunner`) keeps only the token ids and runs the model over all of
them at every step. Stage 2 (`KVCacheRunner`) keeps every layer's keys and values
in a `KVCache`, so a decode step runs the model on one token. Stage 3 (`FlashRunner`)
keeps that cache and computes attention with Triton kernels. The generation loop
(`generate.py`) is the same for all.
"""
from __future__ import annotations

import itertools

import torch

from .attention import naive_attention, sdpa_attention
from .kv import KVCache
from .triton_support import require_triton


def _right_pad(seqs: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
    """(B, T_max) ids, each row padded at the end with token 0 (causal masking hides it), and lengths."""
    lengths = [len(s) for s in seqs]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device=device)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, device=device)
    return ids, lengths


class _Runner:
    """Single-sequence calls are batch calls of one."""

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run the prompt; return the logits (vocab,) for the token after it."""
        return self.prefill_batch([ids])[0]

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; return the logits (vocab,) for the next one."""
        return self.decode_batch([token])[0]


class NaiveRunner(_Runner):
    """Stage 1: no cache. Each call runs the model on every token so far."""

    name = "naive"

    def __init__(self, model, max_len: int | None = None, attn_fn=naive_attention):
        self.model, self.attn_fn = model, attn_fn
        self.seqs: list[list[int]] = []

    @property
    def ids(self) -> list[int]:
        return self.seqs[0]

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        self.seqs = [list(s) for s in seqs]
        return self._last_logits()

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        for s, t in zip(self.seqs, tokens):
            s.append(t)
        return self._last_logits()

    def _last_logits(self) -> torch.Tensor:
        ids, lengths = _right_pad(self.seqs, self.model.device)                 # (B, T)
        logits = self.model(ids, attn_fn=self.attn_fn)                          # (B, T, vocab): all recomputed
        return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]    # (B, vocab)


class KVCacheRunner(_Runner):
    """Stage 2: keys and values of past tokens are kept; a decode step runs one token."""

    name = "kv"

    def __init__(self, model, max_len: int | None = None, attn_fn=sdpa_attention, kv_cache_dtype: str | None = "model"):
        """kv_cache_dtype: None (the model's dtype), "int8" or "int4" (`kv/quantized.py`); by default the
        model's `kv_cache_dtype` (set by `load_model`)."""
        self.model, self.attn_fn = model, attn_fn
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.kv_dtype = getattr(model, "kv_cache_dtype", None) if kv_cache_dtype == "model" else kv_cache_dtype
        self.cache: KVCache | None = None

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        m = self.model
        ids, lengths = _right_pad(seqs, m.device)                                # (B, T)
        self.cache = KVCache(m.cfg, len(seqs), max(self.max_len, ids.shape[1]), m.dtype, m.device, self.kv_dtype)
        positions, mask = self.cache.begin(ids.shape[1])                         # (B, T), None: causal
        logits = m(ids, positions, self.cache, mask, attn_fn=self.attn_fn)       # (B, T, vocab)
        self.cache.commit(lengths)                                               # padding slots stay unused
        return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]     # (B, vocab)

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.model.device)[:, None]            # (B, 1)
        positions, mask = self.cache.begin(1)                                    # (B, 1), (B, 1, 1, S) or None
        logits = self.model(ids, positions, self.cache, mask, attn_fn=self.attn_fn)  # (B, 1, vocab)
        self.cache.commit()
        return logits[:, -1]                                                     # (B, vocab)

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        """Append tokens (one sequence); logits (T, vocab) after each. With n_layers, only the first
        n_layers layers run (and store K/V): a layer-skipping draft sharing this cache."""
        ids = torch.tensor([tokens], device=self.model.device)                  # (1, T)
        positions, mask = self.cache.begin(len(tokens))                         # (1, T)
        logits = self.model(ids, positions, self.cache, mask, attn_fn=self.attn_fn, n_layers=n_layers)
        self.cache.commit()
        return logits[0]                                                         # (T, vocab)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens. Slots past it are simply overwritten later."""
        self.cache.truncate(length)


class FlashRunner(KVCacheRunner):
    """Stage 3: the same KV cache, attention by the Triton kernels of `attention/triton_flash.py`
    (prefill: `flash_attn_varlen`; decode: `decode_attention`, split along the keys).

    On a CPU the kernels run through the Triton interpreter, which must be switched on
    (TRITON_INTERPRET=1) before triton is first imported; `python -m minillm` does that for you.
    """

    name = "flash"

    def __init__(self, model, max_len: int | None = None):
        require_triton("stage flash")
        from .attention import triton_flash

        self.kernels = triton_flash
        self._seqlens: torch.Tensor | None = None   # keys per sequence during a decode step
        super().__init__(model, max_len, attn_fn=self._attention)

    def _attention(self, q, k, v, mask=None):
        """q: (B, H, T, hd); k, v: (B, n_kv, S, hd) views of the cache -> (B, H, T, hd)."""
        B, H, T, hd = q.shape
        S = k.shape[2]
        if T == 1:                                                    # decode: every sequence at once
            out = self.kernels.decode_attention(q[:, :, 0], k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                                self._seqlens)        # (B, H, hd)
            return out[:, :, None]
        # prefill: one packed sequence per batch row (right padding is hidden by causal masking)
        cu_q = torch.tensor([0, T], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, S], dtype=torch.int32, device=q.device)
        outs = [self.kernels.flash_attn_varlen(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
                                               cu_q, cu_k, T, S, causal=True)     # (T, H, hd)
                for b in range(B)]
        return torch.stack(outs).transpose(1, 2)                      # (B, H, T, hd)

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        self._seqlens = torch.tensor([n + 1 for n in self.cache.lengths], dtype=torch.int32,
                                     device=self.model.device)
        return super().decode_batch(tokens)

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        self._seqlens = torch.tensor([self.length + len(tokens)], dtype=torch.int32, device=self.model.device)
        return super().extend(tokens, n_layers)


class _PagedCache:
    """What the model sees as `cache`: writes each layer's new K/V into their slots of the pool."""

    def __init__(self, runner: "PagedRunner"):
        self.runner = runner

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        r = self.runner
        k_new = torch.cat([k[b, :, :n].transpose(0, 1) for b, n in enumerate(r.step_lengths)])  # (tokens, n_kv, hd)
        v_new = torch.cat([v[b, :, :n].transpose(0, 1) for b, n in enumerate(r.step_lengths)])
        r.kernels.write_kv_to_slots(k_new, v_new, r.pool.k[layer], r.pool.v[layer], r.slots)
        return r.pool.k[layer], r.pool.v[layer]                      # (num_blocks, block_size, n_kv, hd)


class PagedRunner(_Runner):
    """Stage 4: K/V in a pool of fixed-size blocks, allocated as sequences grow (`kv/paged.py`);
    attention reads them through block tables (Triton kernels, `attention/triton_paged.py`)."""

    name = "paged"

    def __init__(self, model, max_len: int | None = None, block_size: int = 16, num_blocks: int | None = None):
        if getattr(model, "kv_cache_dtype", None):
            raise ValueError(f"the paged stage's Triton kernels store float K/V; kv_cache_dtype="
                             f"{model.kv_cache_dtype!r} works with the kv, flash and continuous stages")
        require_triton("stage paged")
        from .attention import triton_paged
        from .kv import BlockPool

        self.model, self.kernels = model, triton_paged
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self._pool_cls = BlockPool
        self.pool = None
        self.seqs: list[int] = []
        self.step_lengths: list[int] = []   # new tokens per sequence in this step
        self.slots: torch.Tensor | None = None

    def _attention(self, q, k_pool, v_pool, mask=None):
        """q: (B, H, T, hd) -> (B, H, T, hd), keys and values read through the block tables."""
        B, H, T, hd = q.shape
        table = self.pool.block_table(self.seqs)
        lengths = torch.tensor([self.pool.lengths[s] for s in self.seqs], dtype=torch.int32, device=q.device)
        if T == 1:
            return self.kernels.decode_attention(q[:, :, 0], k_pool, v_pool, lengths, block_table=table)[:, :, None]
        new = self.step_lengths
        qp = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(new)])             # (tokens, H, hd)
        cu_q = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device=q.device)
        cu_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0).int()])
        out_p = self.kernels.flash_attn_varlen(qp, k_pool, v_pool, cu_q, cu_k, max(new), int(lengths.max()),
                                               causal=True, block_table=table)               # (tokens, H, hd)
        out = q.new_zeros(B, H, T, hd)
        for b, (start, n) in enumerate(zip(cu_q[:-1].tolist(), new)):
            out[b, :, :n] = out_p[start:start + n].transpose(0, 1)
        return out

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, n_layers: int | None = None) -> torch.Tensor:
        return self.model(ids, positions, _PagedCache(self), None, attn_fn=self._attention, n_layers=n_layers)

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        m = self.model
        ids, lengths = _right_pad(seqs, m.device)                                  # (B, T)
        per_seq = -(-max(self.max_len, ids.shape[1]) // self.block_size)
        self.pool = self._pool_cls(m.cfg, self.num_blocks or len(seqs) * per_seq, self.block_size, m.dtype, m.device)
        self.seqs = list(range(len(seqs)))
        self.step_lengths = lengths
        self.slots = torch.cat([self.pool.allocate(s, n) for s, n in zip(self.seqs, lengths)])
        positions = torch.arange(ids.shape[1], device=m.device).expand(len(seqs), -1)  # (B, T)
        logits = self._forward(ids, positions)                                      # (B, T, vocab)
        return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.model.device)[:, None]              # (B, 1)
        positions = torch.tensor([[self.pool.lengths[s]] for s in self.seqs], device=self.model.device)
        self.step_lengths = [1] * len(self.seqs)
        self.slots = torch.cat([self.pool.append_slots(s, 1) for s in self.seqs])
        return self._forward(ids, positions)[:, -1]                                # (B, vocab)

    @property
    def length(self) -> int:
        return self.pool.lengths[self.seqs[0]]

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        start, T = self.length, len(tokens)
        ids = torch.tensor([tokens], device=self.model.device)                     # (1, T)
        positions = torch.arange(start, start + T, device=self.model.device)[None]  # (1, T)
        self.step_lengths = [T]
        self.slots = self.pool.append_slots(self.seqs[0], T)
        return self._forward(ids, positions, n_layers)[0]                          # (T, vocab)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens; blocks past them go back to the pool."""
        self.pool.truncate(self.seqs[0], length)


STAGES = {"naive": NaiveRunner, "kv": KVCacheRunner, "flash": FlashRunner, "paged": PagedRunner}


def make_runner(model, stage: str = "naive", max_len: int | None = None):
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    return STAGES[stage](model, max_len)
