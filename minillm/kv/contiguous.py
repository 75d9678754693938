"""Stage 2: the contiguous KV cache.

Without a cache, decode step t recomputes the keys and values of all t earlier
tokens, in every layer, although they never change (a token's K and V depend
only on it and the tokens before it). The cache keeps them:

    K, V: (n_layers, batch, n_kv_heads, max_len, head_dim)   preallocated, per sequence

Prefill writes the prompt's K/V into slots 0 .. P-1; each decode step writes one
new slot and attends over all slots so far. Slot s holds position s, so a query
at position p may attend slots 0 .. p (`mask_from_positions`), which also hides
a shorter sequence's unused slots in a batch.

The model sees the cache through `CachedAttention`, its attention context (`model.py`): in each
layer it stores the new K/V and attends the queries over everything cached.

Size: tokens x layers x kv_heads x head_dim x 2 (K and V) x bytes per value. With
`kv_dtype="int8"` or `"int4"` the values are stored quantized (`quantized.py`) and read back
dequantized: 1 or 1/2 byte per value, plus a float16 scale per token and KV head.
"""
from __future__ import annotations

import torch

from ..attention import mask_from_positions, sdpa_attention
from ..config import ModelConfig
from .quantized import QuantizedKV, kv_bytes_per_value, kv_tensors


def kv_cache_bytes(cfg: ModelConfig, num_tokens: int, dtype: torch.dtype = torch.float32,
                   kv_dtype: str | None = None) -> int:
    """Bytes of K and V for `num_tokens` tokens: tokens x layers x kv_heads x head_dim x 2 x bytes per value."""
    per_value = kv_bytes_per_value(kv_dtype, cfg.head_dim, dtype)
    return int(num_tokens * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * per_value)


class KVCache:
    """K/V for a batch of sequences, each up to `max_len` tokens, preallocated."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", kv_dtype: str | None = None):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k, self.v = kv_tensors(shape, dtype, device, kv_dtype)
        self._layers = [(self.k[i], self.v[i]) for i in range(cfg.n_layers)]   # views, each (B, n_kv, max_len, hd)
        self.max_len = max_len
        self.lengths = [0] * batch   # tokens stored per sequence
        self._starts: list[int] = []  # where this step writes, per sequence
        self._starts_t: torch.Tensor | None = None   # the same, as a tensor (for `in_place`)
        self._T = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def begin(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a step of T new tokens per sequence, written after what each already has.

        Returns positions (B, T) for RoPE and the attention mask (B, 1, T, S), or None
        when every sequence holds the same number of tokens (then plain causal masking is right)."""
        self._starts, self._T = list(self.lengths), T
        self._uniform = len(set(self._starts)) == 1
        self._end = end = max(self._starts) + T
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens needed, {self.max_len} allocated")
        self._starts_t = starts = torch.tensor(self._starts, device=self.k.device)     # (B,) int64
        positions = starts[:, None] + torch.arange(T, device=self.k.device)  # (B, T)
        return positions, None if self._uniform else mask_from_positions(positions, end)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv, T, hd) for `layer`; return all cached K, V (B, n_kv, S, hd)."""
        T, (k_all, v_all) = self._T, self._layers[layer]
        if self._uniform:  # everyone writes the same slots: one copy
            s = self._starts[0]
            k_all[:, :, s:s + T] = k
            v_all[:, :, s:s + T] = v
        else:
            for b, s in enumerate(self._starts):
                k_all[b, :, s:s + T] = k[b]
                v_all[b, :, s:s + T] = v[b]
        end = self._end
        k, v = k_all[:, :, :end], v_all[:, :, :end]
        if isinstance(k, QuantizedKV):   # attention reads them back in the model's dtype
            return k.dequantize(), v.dequantize()
        return k, v

    def in_place(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(K, V, starts) of `layer` for code that writes this step's K/V and attends in place (`c_block.py`):
        the layer's cache (B, n_kv, max_len, hd) and each sequence's first new slot (B,) int64; None where
        the cache is not plain float32 on the CPU (quantized, bfloat16, a GPU's)."""
        k, v = self._layers[layer]
        plain = isinstance(k, torch.Tensor) and not isinstance(k, QuantizedKV)
        if self._starts_t is None or not plain or k.dtype != torch.float32 or k.device.type != "cpu":
            return None
        return k, v, self._starts_t

    def commit(self, new_tokens: list[int] | None = None) -> None:
        """After the forward pass: each sequence now holds `new_tokens[b]` more tokens
        (default: all T; a right-padded prefill keeps only each prompt's real length)."""
        new_tokens = new_tokens or [self._T] * len(self.lengths)
        self.lengths = [n + m for n, m in zip(self.lengths, new_tokens)]

    def truncate(self, length: int, seq: int = 0) -> None:
        """Roll sequence `seq` back to its first `length` tokens (speculative decoding drops rejected
        drafts). Nothing is erased: the slots past `length` are never read and are overwritten next."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate to {length} tokens: the sequence holds {self.lengths[seq]}")
        self.lengths[seq] = length


class CachedAttention:
    """Stages 2-3's attention context: store this step's K/V in `cache`, attend over all it holds.

    attn_fn(q, k, v, mask) does the attending: SDPA (stage 2) or the Triton kernels (stage 3)."""

    def __init__(self, cache: KVCache, attn_fn, mask: torch.Tensor | None = None):
        self.cache, self.attn_fn, self.mask = cache, attn_fn, mask

    def attend(self, layer: int, q, k, v):
        k, v = self.cache.update(layer, k, v)                           # (B, n_kv, S, hd)
        return self.attn_fn(q, k, v, self.mask)                         # (B, H, T, hd)

    def in_place(self, layer: int):
        """The cache of `layer` for a block that stores and attends in C (`c_block.layer`), where that is the
        same computation as `attend`: causal SDPA, no mask of its own (sequences of one length), a float32
        cache. None otherwise."""
        if self.mask is not None or self.attn_fn is not sdpa_attention:
            return None
        return self.cache.in_place(layer)
