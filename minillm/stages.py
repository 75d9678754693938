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
keeps that cache and computes attention with Triton kernels. Stage 4 (`PagedRunner`)
keeps K/V in pages of a block pool and packs every sequence's new tokens into one flat
sequence, as the serving engine (stage 5, `engine/runner.py`) does: the engine's runner
is this one with a scheduler in front. What differs from stage to stage is the model's
attention context (`model.py`): FullAttention, CachedAttention, PagedAttention.
The generation loop (`generate.py`) is the same for all.

kv_cache_dtype (stages 2-4): None (the model's dtype), "int8" or "int4": how the cache stores K and V
(`kv/quantized.py`).
"""
from __future__ import annotations

import torch

from .attention import sdpa_attention
from .attention.paged import check_backend
from .backends import backend_of
from .kv import BlockPool, CachedAttention, KVCache
from .kv.manager import KVCacheManager, Sequence
from .kv.quantized import check_kv_dtype
from .model import FullAttention
from .paged_forward import PagedForward, pack
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

    def __init__(self, model, max_len: int | None = None, attn_fn=None, kv_cache_dtype: str | None = None):
        if kv_cache_dtype:
            raise ValueError(f"the naive stage keeps no KV cache; kv_cache_dtype={kv_cache_dtype!r} works with "
                             "the kv, flash, paged and continuous stages")
        self.model, self.attn_fn = model, attn_fn or model.attn_fn
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
        logits = self.model(ids, attn=FullAttention(self.attn_fn))             # (B, T, vocab): all recomputed
        return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]    # (B, vocab)


class KVCacheRunner(_Runner):
    """Stage 2: keys and values of past tokens are kept; a decode step runs one token."""

    name = "kv"

    def __init__(self, model, max_len: int | None = None, attn_fn=sdpa_attention, kv_cache_dtype: str | None = None):
        check_kv_dtype(kv_cache_dtype)
        self.model, self.attn_fn, self.kv_dtype = model, attn_fn, kv_cache_dtype
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.cache: KVCache | None = None

    def _forward(self, ids: torch.Tensor, n_layers: int | None = None) -> torch.Tensor:
        """ids (B, T), written after what each sequence holds -> logits (B, T, vocab)."""
        positions, mask = self.cache.begin(ids.shape[1])                         # (B, T), None: causal
        return self.model(ids, positions, CachedAttention(self.cache, self.attn_fn, mask), n_layers=n_layers)

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        m = self.model
        ids, lengths = _right_pad(seqs, m.device)                                # (B, T)
        self.cache = KVCache(m.cfg, len(seqs), max(self.max_len, ids.shape[1]), m.dtype, m.device, self.kv_dtype)
        logits = self._forward(ids)                                              # (B, T, vocab)
        self.cache.commit(lengths)                                               # padding slots stay unused
        return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]     # (B, vocab)

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.model.device)[:, None]            # (B, 1)
        logits = self._forward(ids)                                              # (B, 1, vocab)
        self.cache.commit()
        return logits[:, -1]                                                     # (B, vocab)

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        """Append tokens (one sequence); logits (T, vocab) after each. With n_layers, only the first
        n_layers layers run (and store K/V): a layer-skipping draft sharing this cache."""
        logits = self._forward(torch.tensor([tokens], device=self.model.device), n_layers)   # (1, T, vocab)
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

    def __init__(self, model, max_len: int | None = None, kv_cache_dtype: str | None = None,
                 enforce_eager: bool = False):
        """On a GPU, decode steps replay a CUDA graph (`cuda_graphs.py`) unless enforce_eager, or the cache
        is quantized; `cuda_graphs` says whether they do."""
        require_triton("stage flash")
        from .attention import triton_flash

        self.kernels = triton_flash
        self._seqlens: torch.Tensor | None = None   # keys per sequence during a decode step
        self._longest = 0                           # and the most of them
        super().__init__(model, max_len, attn_fn=self._attention, kv_cache_dtype=kv_cache_dtype)
        self.cuda_graphs = model.device.type == "cuda" and not enforce_eager and kv_cache_dtype is None
        self._graph = None                          # ContiguousDecodeGraph of the current cache

    def _attention(self, q, k, v, mask=None):
        """q: (B, H, T, hd); k, v: (B, n_kv, S, hd) views of the cache -> (B, H, T, hd)."""
        B, H, T, hd = q.shape
        S = k.shape[2]
        if T == 1:                                                    # decode: every sequence at once
            out = self.kernels.decode_attention(q[:, :, 0], k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                                self._seqlens, max_seqlen_k=self._longest)   # (B, H, hd)
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
        if self.cuda_graphs:
            if self._graph is None or self._graph.cache is not self.cache:    # a new prefill, a new cache
                from .cuda_graphs import ContiguousDecodeGraph

                self._graph = ContiguousDecodeGraph(self.model, self.cache)
            logits = self._graph.run(tokens)                                   # (B, vocab)
            self.cache.commit([1] * len(tokens))
            return logits
        lengths = [n + 1 for n in self.cache.lengths]
        self._seqlens = torch.tensor(lengths, dtype=torch.int32, device=self.model.device)
        self._longest = max(lengths)         # the keys the kernel reads, not the cache's capacity
        return super().decode_batch(tokens)

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        self._longest = self.length + len(tokens)
        self._seqlens = torch.tensor([self._longest], dtype=torch.int32, device=self.model.device)
        return super().extend(tokens, n_layers)


class PagedRunner(_Runner):
    """Stage 4: K/V in a pool of fixed-size blocks, allocated as sequences grow (`kv/paged.py`, changed
    only through the KV-cache manager, `kv/manager.py`). Each step packs every sequence's new tokens
    into one flat sequence and runs one pass over it (`paged_forward.py`, the object the engine's runner
    holds too); attention writes and reads them through block tables (`attention/paged.py`: the Triton
    kernels of `triton_paged.py` by default, or "torch", gathered pages + SDPA)."""

    name = "paged"

    def __init__(self, model, max_len: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_dtype: str | None = None, attention: str = "triton"):
        check_kv_dtype(kv_cache_dtype)
        self.model, self.kv_dtype = model, kv_cache_dtype
        self.attention = check_backend(attention, model.device.type == "cuda", "stage paged",
                                       native=backend_of(model) == "native")
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.paged: PagedForward | None = None     # made with each prefill's pool
        self.seqs: list[Sequence] = []

    @property
    def kv(self) -> KVCacheManager:
        return self.paged.kv

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def _step(self, new: list[list[int]], n_layers: int | None = None, every_row: bool = False) -> torch.Tensor:
        """Append new[i] to sequence i, all in one pass: logits of each one's last token (every_row: of
        each new token)."""
        starts = [self.kv.num_slots(seq) for seq in self.seqs]
        for seq, tokens in zip(self.seqs, new):
            self.kv.append(seq, len(tokens))
        step = pack(zip(starts, new))
        rows = list(range(len(step.ids))) if every_row else step.last_rows()
        return self.paged(step, [self.kv.block_table(s) for s in self.seqs], rows, n_layers)

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        m = self.model
        if min(len(s) for s in seqs) < 1:
            raise ValueError("every prompt needs at least one token")
        per_seq = -(-max(self.max_len, *map(len, seqs)) // self.block_size)
        pool = BlockPool(m.cfg, self.num_blocks or len(seqs) * per_seq, self.block_size, m.dtype, m.device, self.kv_dtype)
        self.paged = PagedForward(m, KVCacheManager(pool), self.attention)
        self.seqs = [Sequence(i) for i in range(len(seqs))]
        for s in self.seqs:
            self.kv.admit(s, [])
        return self._step([list(s) for s in seqs])                                  # (B, vocab)

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int]) -> torch.Tensor:
        return self._step([[t] for t in tokens])                                    # (B, vocab)

    @property
    def length(self) -> int:
        return self.kv.num_slots(self.seqs[0])

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_layers: int | None = None) -> torch.Tensor:
        return self._step([list(tokens)], n_layers, every_row=True)                 # (T, vocab)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens; blocks past them go back to the pool."""
        self.kv.truncate(self.seqs[0], length)


STAGES = {"naive": NaiveRunner, "kv": KVCacheRunner, "flash": FlashRunner, "paged": PagedRunner}


def make_runner(model, stage: str = "naive", max_len: int | None = None, kv_cache_dtype: str | None = None,
                enforce_eager: bool = False):
    """enforce_eager: no CUDA graphs (stage flash on a GPU captures its decode step otherwise)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    extra = {"enforce_eager": enforce_eager} if stage == "flash" else {}
    return STAGES[stage](model, max_len, kv_cache_dtype=kv_cache_dtype, **extra)
