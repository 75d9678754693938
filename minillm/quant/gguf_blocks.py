"""The GGUF file's own quantized blocks, as packed tensors: the model in the file, bit for bit.

The course model ships as a 4-bit file. Every weight matrix but the embedding is stored in llama.cpp's
**Q4_1** blocks, 32 weights of one row each, 20 bytes:

    d, m         two float16: the block's scale and minimum
    qs[16]       16 bytes, two 4-bit codes q in 0..15 per byte:
                 low nibble of qs[j] -> weight j, high nibble -> weight j + 16
    weight  =    q * d + m

The embedding (tied to the output head) is **Q8_0**: blocks of 32 int8 codes with one float16 scale,
34 bytes, weight = q * d.

`weights.py` dequantizes all of them to float32 (538 MB for this model). Here they are only re-laid
out, no arithmetic, into one tensor per field, so a quantized model can use the file's values exactly
rather than re-quantizing its dequantized weights:

    Q4Weight   packed (out, in/2) uint8 (the bytes of qs, in file order), scale and min (out, in/32) float16
    Q8Weight   q (out, in) int8, scale (out, in/32) float16

`dequantize()` on either gives float32 equal, bit for bit, to the `gguf` package's dequantizer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32      # weights per block, both formats


@dataclass
class Q4Weight:
    packed: torch.Tensor    # (out, in // 2) uint8: per block, 16 bytes of two codes each (see above)
    scale: torch.Tensor     # (out, in // group) float16: d
    min: torch.Tensor       # (out, in // group) float16: m

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def group(self) -> int:
        """Weights per scale and minimum: 32 in the file; a multiple of 32 where `quantize_q4_1` chose more.
        The codes are packed in blocks of 32 either way."""
        return self.shape[1] // self.scale.shape[1]

    def per_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d and m (out, in // 32), one per block of 32 codes (repeated where a group spans several blocks):
        for kernels that walk the codes block by block."""
        r = self.group // GROUP
        return (self.scale, self.min) if r == 1 else (self.scale.repeat_interleave(r, 1),
                                                      self.min.repeat_interleave(r, 1))

    def codes(self) -> torch.Tensor:
        """(out, in) uint8 codes 0..15, in weight order."""
        out, half = self.packed.shape
        b = self.packed.view(out, half // 16, 16)                       # (out, blocks, 16)
        return torch.cat([b & 0x0F, b >> 4], dim=-1).view(out, half * 2)   # low nibbles first, then high

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: q * d + m per group, as llama.cpp computes it."""
        out, n = self.shape
        q = self.codes().view(out, n // self.group, self.group).float()
        return (q * self.scale.float()[..., None] + self.min.float()[..., None]).view(out, n)

    def permute_rows(self, order: torch.Tensor) -> "Q4Weight":
        """The same weight with its output rows reordered (blocks run along a row, so rows move whole)."""
        return Q4Weight(self.packed[order], self.scale[order], self.min[order])


@dataclass
class Q8Weight:
    q: torch.Tensor         # (out, in) int8
    scale: torch.Tensor     # (out, in // 32) float16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        out, n = self.q.shape
        q = self.q.view(out, n // GROUP, GROUP).float()
        return (q * self.scale.float()[..., None]).view(out, n)


def _blocks(tensor, kind: str, block_bytes: int) -> tuple[np.ndarray, int, int]:
    """A GGUF tensor's raw bytes as (out, blocks, block_bytes), checking its type and size."""
    if tensor.tensor_type.name != kind:
        raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}, not {kind}")
    n_in, n_out = (int(d) for d in tensor.shape)            # GGUF lists the fastest-varying dimension first
    if n_in % GROUP:
        raise ValueError(f"{tensor.name}: rows of {n_in} weights are not whole blocks of {GROUP}")
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n_out, n_in // GROUP, block_bytes)
    return raw, n_out, n_in


def read_q4_1(tensor) -> Q4Weight:
    """A GGUF Q4_1 tensor (gguf.ReaderTensor) -> Q4Weight, without dequantizing."""
    raw, n_out, n_in = _blocks(tensor, "Q4_1", 4 + GROUP // 2)
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0]          # (out, blocks)
    m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(raw[..., 4:]).reshape(n_out, n_in // 2)          # (out, in / 2)
    return Q4Weight(torch.from_numpy(qs), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def read_q8_0(tensor) -> Q8Weight:
    """A GGUF Q8_0 tensor -> Q8Weight, without dequantizing."""
    raw, n_out, n_in = _blocks(tensor, "Q8_0", 2 + GROUP)
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n_out, n_in)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(d.copy()))
