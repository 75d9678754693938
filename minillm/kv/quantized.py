"""A quantized KV cache: int8 or 4-bit keys and values, quantized on write, dequantized on read.

The cache grows with every token; at long contexts or many sequences it, not the weights, fills the
memory. Each cached vector x (head_dim values of one token and one KV head) is stored as

    int8:  q = round(x / s), s = max|x| / 127, q in -127..127         1 byte per value + s (float16)
    int4:  per group of 32 values, like the weights' Q4_1:             half a byte per value + d, m
           q = round((x - m) / d), m = min, d = (max - min) / 15,     (float16) per group
           two codes per byte (low nibble: value 2j, high: 2j + 1)

Per value that is 1 + 2/head_dim bytes (int8: 1.03 for head_dim 64, half of float16's 2) and
0.5 + 4/32 (int4: 0.625, under a third of float16's). 4-bit keys need the groups and the minimum:
RoPE'd keys carry a few large channels, and one symmetric scale per 64 values moves the model's
next-token distribution 5x further (mean KL 0.27 vs 0.05 on the held-out text; notebook 12).

`QuantizedKV` stands where a K or V tensor of the cache stood: indexing it (a layer, a block) gives a
`QuantizedKV` of that part, so the caches' code reads the same with either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("int8", "int4")
GROUP4 = 32     # int4: values per (d, m) pair


def check_kv_dtype(kv_dtype: str | None) -> None:
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_dtype!r}: choose int8 or int4 (or none: the model's dtype)")


def kv_tensors(shape: tuple[int, ...], dtype: torch.dtype, device, kv_dtype: str | None):
    """K and V storage of `shape` (..., hd), zeroed: float tensors, or `QuantizedKV` for int8 / int4."""
    check_kv_dtype(kv_dtype)
    if kv_dtype:
        return QuantizedKV.zeros(shape, kv_dtype, dtype, device), QuantizedKV.zeros(shape, kv_dtype, dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_value(kv_dtype: str | None, head_dim: int, dtype: torch.dtype) -> float:
    """Bytes one cached value takes, its share of the scales included."""
    if kv_dtype is None:
        return torch.empty(0, dtype=dtype).element_size()
    return 1 + 2 / head_dim if kv_dtype == "int8" else 0.5 + 4 / GROUP4


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hd) -> codes (..., hd) int8 | (..., hd / 2) uint8, and scales (..., 1) | (..., 2 hd / 32) float16."""
    x = x.float()
    if kv_dtype == "int8":
        s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8)                   # (..., 1)
        return torch.round(x / s).clamp(-127, 127).to(torch.int8), s.half()
    g = x.view(*x.shape[:-1], -1, GROUP4)                                             # (..., hd / 32, 32)
    m = g.amin(-1, keepdim=True).half()
    d = ((g.amax(-1, keepdim=True) - m.float()) / 15).clamp_min(1e-8).half()
    q = torch.round((g - m.float()) / d.float()).clamp(0, 15).to(torch.uint8).view(x.shape)   # (..., hd) 0..15
    return q[..., 0::2] | (q[..., 1::2] << 4), torch.cat([d, m], -1).flatten(-2)      # (..., hd/2), (..., 2 hd/32)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kv_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize` (up to rounding): (..., hd) in `dtype`."""
    if kv_dtype == "int8":
        return codes.to(dtype) * scale.to(dtype)
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)                  # (..., hd) 0..15
    g = q.view(*q.shape[:-1], -1, GROUP4).to(dtype)                                   # (..., hd / 32, 32)
    dm = scale.view(*scale.shape[:-1], -1, 2).to(dtype)                               # (..., hd / 32, 2)
    return (g * dm[..., :1] + dm[..., 1:]).view(q.shape)


@dataclass
class QuantizedKV:
    """Codes and scales of cached K (or V) values, indexed like the float tensor they replace."""
    codes: torch.Tensor      # (..., hd) int8 | (..., hd / 2) uint8
    scale: torch.Tensor      # (..., 1) | (..., 2 hd / 32) float16
    kv_dtype: str
    dtype: torch.dtype       # what reading gives back

    @classmethod
    def zeros(cls, shape: tuple[int, ...], kv_dtype: str, dtype: torch.dtype, device) -> "QuantizedKV":
        """Room for float values of `shape` (..., hd)."""
        *lead, hd = shape
        if kv_dtype == "int8":
            codes, scales = torch.zeros((*lead, hd), dtype=torch.int8), torch.zeros((*lead, 1))
        else:
            codes, scales = torch.zeros((*lead, hd // 2), dtype=torch.uint8), torch.zeros((*lead, 2 * hd // GROUP4))
        return cls(codes.to(device), scales.half().to(device), kv_dtype, dtype)

    def __getitem__(self, idx) -> "QuantizedKV":
        return QuantizedKV(self.codes[idx], self.scale[idx], self.kv_dtype, self.dtype)

    def __setitem__(self, idx, value: "QuantizedKV | torch.Tensor") -> None:
        if isinstance(value, torch.Tensor):
            value = QuantizedKV(*quantize(value, self.kv_dtype), self.kv_dtype, self.dtype)
        self.codes[idx] = value.codes
        self.scale[idx] = value.scale

    def index_copy_(self, dim: int, index: torch.Tensor, x: torch.Tensor) -> "QuantizedKV":
        """Like Tensor.index_copy_: quantize x (..., hd) into the entries `index` along `dim` (not the last)."""
        codes, scale = quantize(x, self.kv_dtype)
        self.codes.index_copy_(dim, index, codes)
        self.scale.index_copy_(dim, index, scale)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> "QuantizedKV":
        return QuantizedKV(self.codes.index_select(dim, index), self.scale.index_select(dim, index),
                           self.kv_dtype, self.dtype)

    def view(self, *shape) -> "QuantizedKV":
        """Reshape the leading (value-count) dims; shape ends with hd like a float tensor's would."""
        *lead, hd = shape
        return QuantizedKV(self.codes.view(*lead, self.codes.shape[-1]), self.scale.view(*lead, self.scale.shape[-1]),
                           self.kv_dtype, self.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.kv_dtype, self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float values it holds."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * (1 if self.kv_dtype == "int8" else 2))

    def numel(self) -> int:
        return self.codes.numel() * (1 if self.kv_dtype == "int8" else 2)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_cuda(self) -> bool:
        return self.codes.is_cuda

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes
