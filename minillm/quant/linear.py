"""Quantized linear layers: drop-in replacements for `nn.Linear(bias=False)`, y = x @ W^T.

Each format stores fewer bytes per weight and multiplies with the fastest kernel PyTorch has for it
on this device, chosen by measurement (`benchmarks/quantization.py`; the numbers are in notebook 12):

    Int8Linear   int8 weights, one scale per output row (weight-only). Few rows: `_weight_int8pack_mm`;
                 many rows: the weight is dequantized to bfloat16 for one bfloat16 matmul.
    W8A8Linear   int8 weights *and* int8 activations, one scale per token: fbgemm's integer matmul
                 (`quantized::linear_dynamic`), the fastest CPU kernel at every row count measured.
    Q4Linear     4 bits per weight in groups of 32 with a scale and a minimum (llama.cpp's Q4_1).
                 Few rows: `_weight_int4pack_mm_for_cpu`; many rows: dequantized to bfloat16 in the
                 kernel's own layout and multiplied in bfloat16 (slower than float32 below ~256 rows:
                 there is no fast batched 4-bit kernel on the CPU in PyTorch).

Activations enter the weight-only kernels in bfloat16, the one dtype those kernels are fast in on the
CPU (float32 and float16 activations are 10-40x slower there); the kernels accumulate in float32 and
the output goes back to the input's dtype. So a float32 model with quantized weights keeps its norms,
attention and KV cache in float32: mixed precision.

Why these ops and not a library: `torchao` ships its CPU kernels compiled against one torch release
and loads none of them with torch 2.13; `torch.ao.quantization` is deprecated in favour of torchao,
but the `quantized::` fbgemm ops it wraps are part of torch 2.13 and are what W8A8Linear calls
(creating their quantized weight prints a deprecation warning, silenced here). On devices without
these CPU ops, Int8Linear and Q4Linear call a Triton kernel on an NVIDIA GPU (`triton_matmul.py`) that
dequantizes tiles in registers; W8A8Linear (and everything on other devices) dequantizes its weight and
calls `F.linear`: correct, not fast.
"""
from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .gguf_blocks import GROUP, Q4Weight

SMALL_ROWS = 16   # up to this many rows the weight-only kernels beat dequantize + bfloat16 matmul


@lru_cache(maxsize=1)
def cpu_has_vnni() -> bool:
    """Whether the CPU says it has VNNI (8-bit dot products into 32 bits); read on Linux only."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])   # (..., in) -> (rows, in)


class Int8Linear(nn.Module):
    """Weight-only int8: W ~= q * scale, q int8 (out, in), scale (out,) per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)                                # (out, in) int8
        self.register_buffer("scale", scale.float())                # (out,)
        self.register_buffer("scale_bf16", scale.bfloat16())        # what the kernel reads
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Linear":
        w = w.float()
        absmax = torch.maximum(w.amax(dim=1), -w.amin(dim=1))              # (out,) the row's largest |w|,
        scale = absmax.clamp_min(1e-12) / 127                              # without a temporary copy of w
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # one float temporary: the head is 113 MB
        return cls(q, scale)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.to(dtype) * self.scale[:, None].to(dtype))       # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:                                                   # Triton: dequantize in registers
            from .triton_matmul import int8_matmul
            return int8_matmul(x, self.q, self.scale)
        x2 = _rows(x).bfloat16()                                        # (rows, in)
        if x.device.type == "cpu" and x2.shape[0] <= SMALL_ROWS:
            y = torch._weight_int8pack_mm(x2, self.q, self.scale_bf16)  # (rows, out)
        else:
            y = F.linear(x2, self.dequantize(torch.bfloat16))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class W8A8Linear(nn.Module):
    """int8 weights (per output row) and int8 activations (per token), multiplied as integers.

    fbgemm quantizes its input with one scale for the whole tensor: across a batch, one outlier token
    would then flatten the rest. Dividing each row by its own largest |x| first, and multiplying the
    output rows back, gives every token its own scale (and the same result in any batch). `smooth` (in,)
    divides the activations' input channels and multiplies the weight's columns (SmoothQuant): the
    product is unchanged, but outlier channels move into the weight, which quantizes per row and minds
    them less.

    reduce_range: activations in 7 bits instead of 8. x86 CPUs without VNNI instructions add pairs of
    8-bit products in 16 bits, which can overflow with 8-bit activations; fbgemm's remedy is 7 bits,
    which moves the model about 3x further (mean KL 0.06 instead of 0.02 on the held-out text). The
    default: 8 bits where the CPU reports VNNI, 7 elsewhere.
    """

    def __init__(self, w: torch.Tensor, smooth: torch.Tensor | None = None, reduce_range: bool | None = None):
        super().__init__()
        self.per_token = True       # False: one scale for the whole input, as quantize_dynamic does (the lesson)
        w = w.float()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        if smooth is not None:
            w = w * smooth[None, :]                                     # columns scaled up
            self.register_buffer("inv_smooth", (1.0 / smooth).float())
        else:
            self.inv_smooth = None
        self.int8 = Int8Linear.from_float(w)                            # the stored weight, for dequantize()
        self.reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, -1] = -1.0, 1.0
        self.register_buffer("pin", pin)
        self.packed = None
        if hasattr(torch.ops.quantized, "linear_prepack") and w.device.type == "cpu":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")                     # quantized tensors are deprecated
                    qw = torch._make_per_channel_quantized_tensor(
                        self.int8.q, self.int8.scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0)
                    self.packed = torch.ops.quantized.linear_prepack(qw, None)
            except RuntimeError:                                        # no fbgemm here (e.g. an ARM Mac)
                self.packed = None

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        w = self.int8.dequantize(torch.float32)
        if self.inv_smooth is not None:
            w = w * self.inv_smooth[None, :]
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x).float()                                           # (rows, in)
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        tok = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)       # (rows, 1) per-token scale
        if not self.per_token:
            tok = tok.amax().expand_as(tok)                             # the largest over every token
        if self.packed is not None and x.device.type == "cpu":
            # fbgemm picks its grid from the tensor's min and max; one extra row holding -1 and 1 pins it
            # to [-1, 1] whatever the batch, so a token's result does not depend on its neighbours
            xn = torch.cat([x2 / tok, self.pin], dim=0)                       # (rows + 1, in)
            y = torch.ops.quantized.linear_dynamic(xn, self.packed, self.reduce_range)[:-1] * tok
        else:   # the same arithmetic in floating point: round each token to 255 (127) levels, multiply
            levels = 63 if self.reduce_range else 127
            xq = torch.round(x2 / tok * levels).clamp(-levels, levels) * (tok / levels)
            y = F.linear(xq, self.int8.dequantize(torch.float32))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Q4Linear(nn.Module):
    """4-bit weights in groups of 32 along a row: w = q * d + m, q in 0..15 (llama.cpp's Q4_1).

    On the CPU the codes are kept in the layout `_weight_int4pack_mm_for_cpu` reads, which computes
    w = (q - 8) * s + z per group, so s = d and z = m + 8 d, both in bfloat16. Elsewhere they stay
    in the file's layout (`Q4Weight`).
    """

    def __init__(self, w4: Q4Weight, device: str | torch.device = "cpu"):
        super().__init__()
        out, n = w4.shape
        self.in_features, self.out_features = n, out
        d, m = w4.scale.float(), w4.min.float()                                  # (out, in / 32)
        self.cpu_kernel = torch.device(device).type == "cpu" and out % 64 == 0   # the kernel packs 64 rows
        if self.cpu_kernel:
            codes = w4.codes().to(torch.int32)                                   # (out, in) 0..15
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
            s, z = d, m + 8 * d                                                  # w = (q - 8) s + z
            self.register_buffer("scale_zero", torch.stack([s, z], -1).transpose(0, 1).contiguous().bfloat16())
            # d and m laid out like the packed codes, to dequantize many rows at once: w = q d + m
            for name, t in (("d_blocked", d), ("m_blocked", m)):                 # (out/64, in/32, 1, 64)
                t = t.view(out // 64, 64, n // GROUP).permute(0, 2, 1)[:, :, None, :]
                self.register_buffer(name, t.contiguous().bfloat16())
        else:
            for name in ("packed", "scale", "min"):
                self.register_buffer(name, getattr(w4, name).to(device))

    @classmethod
    def from_float(cls, w: torch.Tensor, device="cpu") -> "Q4Linear":
        """Quantize like llama.cpp's Q4_1: per group of 32, m = min, d = (max - min) / 15."""
        return cls(quantize_q4_1(w), device)

    def codes(self) -> torch.Tensor:
        """(out, in) uint8 codes 0..15, unpacked from the kernel's layout: (out/64, in, 32) bytes,
        the low nibble row r of each group of 64 rows, the high nibble row r + 32."""
        if not self.cpu_kernel:
            return Q4Weight(self.packed, self.scale, self.min).codes()
        b = self.packed.view(self.out_features // 64, self.in_features, 32)
        return torch.cat([b & 0x0F, b >> 4], dim=-1).transpose(1, 2).reshape(self.out_features, self.in_features)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """(out, in): the weight this layer multiplies by (scale and zero as the kernel stores them)."""
        if not self.cpu_kernel:
            return Q4Weight(self.packed, self.scale, self.min).dequantize().to(dtype)
        out, n = self.out_features, self.in_features
        s, z = self.scale_zero.to(dtype).transpose(0, 1).unbind(-1)              # (out, in / 32) each
        q = self.codes().view(out, n // GROUP, GROUP).to(dtype)
        return ((q - 8) * s[..., None] + z[..., None]).view(out, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not self.cpu_kernel:                                    # Triton, the file's layout
            from .triton_matmul import q4_matmul
            return q4_matmul(x, self.packed, self.scale, self.min)
        x2 = _rows(x).bfloat16()                                                 # (rows, in)
        if not self.cpu_kernel:
            y = F.linear(x2, self.dequantize(torch.bfloat16))
        elif x2.shape[0] <= SMALL_ROWS:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scale_zero)
        else:   # dequantize in the packed layout (no transpose), then one batched bfloat16 matmul
            out, n = self.out_features, self.in_features
            b = self.packed.view(out // 64, n, 32)
            q = torch.cat([b & 0x0F, b >> 4], -1).view(out // 64, n // GROUP, GROUP, 64).bfloat16()
            w = torch.addcmul(self.m_blocked, q, self.d_blocked).view(out // 64, n, 64)   # (out/64, in, 64)
            y = torch.matmul(x2, w).transpose(0, 1).reshape(-1, out)             # (out/64, rows, 64) -> (rows, out)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def quantize_q4_1(w: torch.Tensor) -> Q4Weight:
    """(out, in) float -> Q4Weight: groups of 32, d = (max - min) / 15, m = min, q = round((w - m) / d)."""
    out, n = w.shape
    if n % GROUP:
        raise ValueError(f"4-bit groups need rows of a multiple of {GROUP} weights, not {n}")
    g = w.float().view(out, n // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)                                              # (out, groups)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    q = torch.round((g - m.float()[..., None]) / d.float().clamp_min(1e-12)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).view(out, n // GROUP, 2, GROUP // 2)                   # weights j and j + 16
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out, n // 2)               # low nibble: j; high: j + 16
    return Q4Weight(packed, d, m)
