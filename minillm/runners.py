"""Runners: what changes between stages. A runner turns token ids into next-token logits.

    prefill(ids) -> logits (vocab,)            the prompt, once
    decode(token) -> logits (vocab,)           one new token
    prefill_batch(list of ids) -> (B, vocab)   several prompts of different lengths
    decode_batch(tokens) -> (B, vocab)         one new token for each

Stage 1 (`NaiveRunner`) keeps only the token ids and runs the model over all of
them at every step. Stage 2 (`KVCacheRunner`) keeps every layer's keys and values
in a `KVCache`, so a decode step runs the model on one token. Stage 3 (`FlashRunner`)
keeps that cache and computes attention with Triton kernels. The generation loop
(`generate.py`) is the same for all.
"""
from __future__ import annotations

import torch

from .attention import naive_attention, sdpa_attention
from .kv import KVCache


def _right_pad(seqs: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
    """(B, T_max) ids, each row padded at the end with token 0 (causal masking hides it), and lengths."""
    lengths = [len(s) for s in seqs]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device=device)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, device=device)
    return ids, lengths


class NaiveRunner:
    """Stage 1: no cache. Each call runs the model on every token so far."""

    name = "naive"

    def __init__(self, model, max_len: int | None = None, attn_fn=naive_attention):
        self.model, self.attn_fn = model, attn_fn
        self.seqs: list[list[int]] = []

    @property
    def ids(self) -> list[int]:
        return self.seqs[0]

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run the prompt; return the logits (vocab,) for the token after it."""
        return self.prefill_batch([ids])[0]

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; return the logits (vocab,) for the next one."""
        return self.decode_batch([token])[0]

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


class KVCacheRunner:
    """Stage 2: keys and values of past tokens are kept; a decode step runs one token."""

    name = "kv"

    def __init__(self, model, max_len: int | None = None, attn_fn=sdpa_attention):
        self.model, self.attn_fn = model, attn_fn
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.cache: KVCache | None = None

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.prefill_batch([ids])[0]

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        return self.decode_batch([token])[0]

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        m = self.model
        ids, lengths = _right_pad(seqs, m.device)                                # (B, T)
        self.cache = KVCache(m.cfg, len(seqs), max(self.max_len, ids.shape[1]), m.dtype, m.device)
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


class FlashRunner(KVCacheRunner):
    """Stage 3: the same KV cache, attention by the Triton kernels of `attention/triton_flash.py`
    (prefill: `flash_attn_varlen`; decode: `decode_attention`, split along the keys).

    On a CPU the kernels run through the Triton interpreter, which must be switched on
    (TRITON_INTERPRET=1) before triton is first imported; `python -m minillm` does that for you.
    """

    name = "flash"

    def __init__(self, model, max_len: int | None = None):
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


STAGES = {"naive": NaiveRunner, "kv": KVCacheRunner, "flash": FlashRunner}


def make_runner(model, stage: str = "naive", max_len: int | None = None):
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    return STAGES[stage](model, max_len)
