"""Quantized linear layers: drop-in replacements for `nn.Linear(bias=False)`, y = x @ W^T.

Each format stores fewer bytes per weight and multiplies with the fastest kernel PyTorch has for it
on this device, chosen by measurement (`benchmarks/quantization.py`; the numbers are in notebook 12):

    Int8Linear   int8 weights, one scale per output row (weight-only): `_weight_int8pack_mm`.
    W8A8Linear   int8 weights *and* int8 activations, one scale per token: fbgemm's integer matmul
                 (`quantized::linear_dynamic`), the fastest CPU kernel at every row count measured.
    Q4Linear     4 bits per weight in groups (of 32: llama.cpp's Q4_1; or more) with a scale and a
                 minimum per group: `_weight_int4pack_mm_for_cpu`.

The weight-only kernels are fast for a few rows (a decode step). For many rows (a prompt) the choice
depends on the CPU: where it multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX) the weight is
dequantized to bfloat16 for one bfloat16 matmul; elsewhere (AVX2, ARM) a bfloat16 matmul is slower than
the kernel, which then runs at every row count. `many_rows` on each layer says which, and can be set.

Activations enter the weight-only kernels in bfloat16 (float32 and float16 activations are 10-40x slower
there); the kernels accumulate in float32 and the output goes back to the input's dtype. So a float32
model with quantized weights keeps its norms, attention and KV cache in float32: mixed precision.

Each layer keeps its format's own codes and scales: they are the weight (`dequantize()`), whatever a
kernel does. A kernel may want them repacked first (`_convert_weight_to_int4pack_for_cpu`), into a layout
that is private to ATen and differs by CPU capability (AVX-512, AVX2, default): that copy is the kernel's,
and nothing else reads it. When a layer is built, its kernel multiplies a probe (a row of ones, the
worst case for overflow, and a random row) and is checked against the weight; a kernel that disagrees on
this machine is not used (a warning says so) and the layer dequantizes instead.

Why these ops and not a library: `torchao` ships its CPU kernels compiled against one torch release
and loads none of them with torch 2.13; `torch.ao.quantization` is deprecated in favour of torchao,
but the `quantized::` fbgemm ops it wraps are part of torch 2.13 and are what W8A8Linear calls
(creating their quantized weight prints a deprecation warning, silenced here). On devices without
these CPU ops, Int8Linear and Q4Linear call a Triton kernel on an NVIDIA GPU (`triton_matmul.py`) that
dequantizes tiles in registers; W8A8Linear (and everything on other devices) dequantizes its weight and
calls `F.linear`: correct, not fast.
"""
from __future__ import annotations

import platform
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .gguf_blocks import GROUP, Q4Weight

SMALL_ROWS = 16       # up to this many rows the weight-only kernels beat dequantize + bfloat16 matmul
PROBE_TOLERANCE = 0.05   # a kernel this far from its weight on the probe is wrong (right ones: < 0.02)


@lru_cache(maxsize=1)
def cpu_has_vnni() -> bool:
    """Whether fbgemm's 8-bit kernels can use VNNI (8-bit dot products into 32 bits): AVX512-VNNI.
    fbgemm has no path for the 256-bit AVX-VNNI of recent laptop CPUs; there it adds pairs of 8-bit
    products in 16 bits, as on any AVX2 CPU."""
    return bool(torch.cpu.get_capabilities().get("avx512_vnni"))


@lru_cache(maxsize=1)
def eight_bit_sums_overflow() -> bool:
    """Whether fbgemm's 8-bit products overflow with 8-bit activations: x86 CPUs without AVX512-VNNI add
    pairs of them in 16 bits. ARM CPUs (an Apple-silicon Mac) and GPUs have no such path."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86") and not cpu_has_vnni()


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX). Without either,
    oneDNN widens bfloat16 to float32 on the way and a bfloat16 matmul is slower than a float32 one."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def default_many_rows() -> str:
    """How weight-only layers multiply more than SMALL_ROWS rows on this CPU: "dequantize" (to bfloat16,
    then one bfloat16 matmul) where bfloat16 matmuls are fast, else "kernel" (the weight-only kernel)."""
    return "dequantize" if cpu_has_fast_bf16() else "kernel"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])   # (..., in) -> (rows, in)


def kernel_agrees(kernel, weight, name: str, warn: bool = True) -> bool:
    """Whether kernel(x) (rows, in) -> (rows, out) equals x @ weight^T on a probe: a row of ones (every
    product at its largest, where 16-bit sums overflow) and a random row. Warns and says False if not.
    weight: (out, in), or a function (start, stop) -> its rows start..stop in float32, so that a large
    layer (the 49,152-row head) is never dequantized whole."""
    rows = weight if callable(weight) else (lambda a, b: weight[a:b].float())
    n = rows(0, 1).shape[1]
    probe = torch.cat([torch.ones(1, n), torch.randn(1, n, generator=torch.Generator().manual_seed(0))])
    try:
        y = kernel(probe).float()                                           # (2, out)
        ref = torch.cat([F.linear(probe, rows(a, a + 4096)) for a in range(0, y.shape[1], 4096)], dim=1)
        err = ((y - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-12)).max().item()
    except (RuntimeError, NotImplementedError) as e:
        err, why = float("inf"), f"it fails ({e})"
    else:
        why = f"its result is {err:.2f} (relative) from the weight's"
    if err <= PROBE_TOLERANCE:
        return True
    if warn:
        warnings.warn(f"{name}: {why} on this CPU ({torch.backends.cpu.get_cpu_capability()}); "
                      "not using it (dequantize + matmul instead: correct, slower)", RuntimeWarning, stacklevel=3)
    return False


INT8_KERNEL_CHUNK = 16   # _weight_int8pack_mm needs in_features divisible by it


class Int8Linear(nn.Module):
    """Weight-only int8: W ~= q * scale, q int8 (out, in), scale (out,) per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, kernel: bool = True):
        """kernel=False: hold the codes only (W8A8Linear's weight), no CPU kernel set up or probed."""
        super().__init__()
        self.register_buffer("q", q)                                # (out, in) int8
        self.register_buffer("scale", scale.float())                # (out,)
        self.register_buffer("scale_bf16", scale.bfloat16())        # what the kernel reads
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.many_rows = default_many_rows()
        self.rescore_top = 0        # the output head sets it: see `rescore`
        # ATen's AVX-512 int8 kernel reads each row in whole chunks of 16 values: with in_features not a
        # multiple of 16 it reads past the row (wrong sums or a crash, torch 2.13), so it is not even probed
        self.cpu_kernel = (kernel and q.device.type == "cpu" and self.in_features % INT8_KERNEL_CHUNK == 0
                           and kernel_agrees(self._kernel, self._rows, "_weight_int8pack_mm"))

    @classmethod
    def from_float(cls, w: torch.Tensor, kernel: bool = True) -> "Int8Linear":
        w = w.float()
        absmax = torch.maximum(w.amax(dim=1), -w.amin(dim=1))              # (out,) the row's largest |w|,
        scale = absmax.clamp_min(1e-12) / 127                              # without a temporary copy of w
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # one float temporary: the head is 113 MB
        return cls(q, scale, kernel)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.to(dtype) * self.scale[:, None].to(dtype))       # (out, in)

    def _rows(self, a: int, b: int) -> torch.Tensor:
        return self.q[a:b].float() * self.scale[a:b, None]             # rows a..b of dequantize()

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2.bfloat16(), self.q, self.scale_bf16)   # (rows, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:                                                   # Triton: dequantize in registers
            from .triton_matmul import int8_matmul
            return int8_matmul(x, self.q, self.scale)
        x2 = _rows(x)                                                   # (rows, in)
        if self.cpu_kernel and x.device.type == "cpu" and (x2.shape[0] <= SMALL_ROWS or self.many_rows == "kernel"):
            y = self._kernel(x2)
        else:
            y = _dequantized_matmul(x2, self.dequantize)
        if self.rescore_top and y.dtype != x.dtype == torch.float32:
            y = self.rescore(x2, y)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def rescore(self, x2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The head's logits y (rows, out), computed in bfloat16, with each row's `rescore_top` largest
        recomputed in float32 from x2 (rows, in) float32 and the int8 rows: bfloat16 keeps 8 bits, so two
        logits of 20 closer than 0.08 can swap places, and greedy decoding then picks another token. The
        float32 top few put them back in float32's order (what a float32 head would pick, unless the winner
        was not among them) for a gather of rescore_top rows per row instead of a float32 pass over all."""
        y = y.float()                                                      # (rows, out)
        top = y.topk(self.rescore_top, dim=-1).indices                     # (rows, k)
        w = self.q[top].float() * self.scale[top, None]                    # (rows, k, in)
        exact = (w @ x2.float()[:, :, None]).squeeze(-1)                   # (rows, k)
        return y.scatter_(1, top, exact)


def _dequantized_matmul(x2: torch.Tensor, dequantize) -> torch.Tensor:
    """x2 (rows, in) @ W^T with W dequantized: in bfloat16 where this CPU is fast at it (or off the CPU),
    else in float32."""
    dtype = torch.float32 if x2.device.type == "cpu" and not cpu_has_fast_bf16() else torch.bfloat16
    return F.linear(x2.to(dtype), dequantize(dtype))


class W8A8Linear(nn.Module):
    """int8 weights (per output row) and int8 activations (per token), multiplied as integers.

    fbgemm quantizes its input with one scale for the whole tensor: across a batch, one outlier token
    would then flatten the rest. Dividing each row by its own largest |x| first, and multiplying the
    output rows back, gives every token its own scale (and the same result in any batch). `smooth` (in,)
    divides the activations' input channels and multiplies the weight's columns (SmoothQuant): the
    product is unchanged, but outlier channels move into the weight, which quantizes per row and minds
    them less.

    reduce_range: activations in 7 bits instead of 8. x86 CPUs without AVX512-VNNI add pairs of 8-bit
    products in 16 bits, which overflow with 8-bit activations (a row of ones comes out 12% wrong on an
    AVX2 EPYC); fbgemm's remedy is 7 bits, which moves the model about 3x further (mean KL 0.06 instead
    of 0.02 on the held-out text). The default: 7 bits where those sums overflow (x86 without AVX512-VNNI,
    the weight on the CPU), 8 elsewhere (ARM CPUs, GPUs); if fbgemm then fails the probe (see the module's
    docstring), 7 bits, and if it fails again the same arithmetic in floating point.
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
        self.int8 = Int8Linear.from_float(w, kernel=False)              # the stored weight, for dequantize()
        overflow = w.device.type == "cpu" and eight_bit_sums_overflow()
        self.reduce_range = overflow if reduce_range is None else reduce_range
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
        if self.packed is not None:
            self._check_kernel(auto=reduce_range is None)

    def _check_kernel(self, auto: bool) -> None:
        """Keep fbgemm only if it multiplies by the weight: at 8 bits, then (if the bits were ours to
        choose) at 7; else the floating-point emulation."""
        retry = auto and not self.reduce_range                         # the weight: smoothed columns, as
        ok = kernel_agrees(self._fbgemm, self.int8._rows, "quantized::linear_dynamic", warn=not retry)   # _fbgemm's x
        if not ok and retry:
            self.reduce_range = True
            ok = kernel_agrees(self._fbgemm, self.int8._rows, "quantized::linear_dynamic")
        if not ok:
            self.packed = None

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        w = self.int8.dequantize(torch.float32)
        if self.inv_smooth is not None:
            w = w * self.inv_smooth[None, :]
        return w.to(dtype)

    def _fbgemm(self, x2: torch.Tensor) -> torch.Tensor:
        """fbgemm on x2 (rows, in), already smoothed: each row divided by its own largest |x| first."""
        tok = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)       # (rows, 1) per-token scale
        if not self.per_token:
            tok = tok.amax().expand_as(tok)                             # the largest over every token
        # fbgemm picks its grid from the tensor's min and max; one extra row holding -1 and 1 pins it
        # to [-1, 1] whatever the batch, so a token's result does not depend on its neighbours
        xn = torch.cat([x2.float() / tok, self.pin], dim=0)                    # (rows + 1, in)
        return torch.ops.quantized.linear_dynamic(xn, self.packed, self.reduce_range)[:-1] * tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x).float()                                           # (rows, in)
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        if self.packed is not None and x.device.type == "cpu":
            y = self._fbgemm(x2)
        else:   # the same arithmetic in floating point: round each token to 255 (127) levels, multiply
            tok = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)   # (rows, 1) per-token scale
            if not self.per_token:
                tok = tok.amax().expand_as(tok)
            levels = 63 if self.reduce_range else 127
            xq = torch.round(x2 / tok * levels).clamp(-levels, levels) * (tok / levels)
            y = F.linear(xq, self.int8.dequantize(torch.float32))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Q4Linear(nn.Module):
    """4-bit weights in groups along a row: w = q * d + m, q in 0..15, one d and m per group (llama.cpp's
    Q4_1 where the group is 32; `quantize_model(.., "q4")` uses groups of Q4_GROUP).

    `packed`, `scale` and `min` are the format's own codes and scales (`Q4Weight`: for q4_file, the
    file's bytes): the weight. On a CPU the kernel `_weight_int4pack_mm_for_cpu` gets its own copy of the
    codes, repacked by `_convert_weight_to_int4pack_for_cpu` into a layout that differs by CPU
    capability, with a scale and a zero per group, w = (q - 8) s + z, so s = d and z = m + 8 d (both in
    bfloat16). Only that kernel reads its copy; those buffers are not saved with the model.
    """

    def __init__(self, w4: Q4Weight, device: str | torch.device = "cpu"):
        super().__init__()
        out, n = w4.shape
        self.in_features, self.out_features = n, out
        for name in ("packed", "scale", "min"):                                  # the format, as stored
            self.register_buffer(name, getattr(w4, name).to(device))
        if w4.group != GROUP:                    # the GPU kernel walks blocks of 32: a d and m per block, made once
            for name, t in zip(("block_scale", "block_min"), w4.per_block()):
                self.register_buffer(name, t.to(device), persistent=False)
        self.many_rows = default_many_rows()
        self.cpu_kernel = torch.device(device).type == "cpu" and out % 64 == 0   # the kernel packs 64 rows
        if self.cpu_kernel:
            d, m = w4.scale.float(), w4.min.float()                              # (out, in / group)
            codes = w4.codes().to(torch.int32)                                   # (out, in) 0..15
            self.register_buffer("kernel_packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1),
                                 persistent=False)
            s_z = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous().bfloat16()   # (in / group, out, 2)
            self.register_buffer("kernel_scale_zero", s_z, persistent=False)
            self.cpu_kernel = kernel_agrees(self._kernel, lambda a, b: Q4Weight(
                w4.packed[a:b], w4.scale[a:b], w4.min[a:b]).dequantize(), "_weight_int4pack_mm_for_cpu")

    @classmethod
    def from_float(cls, w: torch.Tensor, device="cpu", group: int = GROUP) -> "Q4Linear":
        """Quantize like llama.cpp's Q4_1: per group of `group` weights, m = min, d = (max - min) / 15."""
        return cls(quantize_q4_1(w, group), device)

    @property
    def group(self) -> int:
        return self.weight4().group

    def weight4(self) -> Q4Weight:
        return Q4Weight(self.packed, self.scale, self.min)

    def codes(self) -> torch.Tensor:
        """(out, in) uint8 codes 0..15, in weight order."""
        return self.weight4().codes()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """(out, in): q * d + m. In float32 exactly the format's values (for q4_file, llama.cpp's)."""
        if dtype == torch.float32:
            return self.weight4().dequantize()
        out, n = self.out_features, self.in_features
        q = self.codes().view(out, n // self.group, self.group).to(dtype)        # (out, in / group, group)
        return (q * self.scale.to(dtype)[..., None] + self.min.to(dtype)[..., None]).view(out, n)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x2.bfloat16(), self.kernel_packed, self.group,
                                                 self.kernel_scale_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:                                                            # Triton, the file's layout
            from .triton_matmul import q4_matmul
            per_block = (self.block_scale, self.block_min) if self.group != GROUP else (self.scale, self.min)
            return q4_matmul(x, self.packed, *per_block)                        # d, m per block of 32
        x2 = _rows(x)                                                            # (rows, in)
        if self.cpu_kernel and x.device.type == "cpu" and (x2.shape[0] <= SMALL_ROWS or self.many_rows == "kernel"):
            y = self._kernel(x2)                                                 # (rows, out)
        else:
            y = _dequantized_matmul(x2, self.dequantize)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def quantize_q4_1(w: torch.Tensor, group: int = GROUP) -> Q4Weight:
    """(out, in) float -> Q4Weight: groups of `group` (a multiple of 32), d = (max - min) / 15, m = min,
    q = round((w - m) / d). The codes are packed in blocks of 32 whatever the group."""
    out, n = w.shape
    if group % GROUP or n % group:
        raise ValueError(f"4-bit groups are a multiple of {GROUP} weights that divides the row ({n}), not {group}")
    g = w.float().view(out, n // group, group)
    lo, hi = g.amin(-1), g.amax(-1)                                              # (out, groups)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    q = torch.round((g - m.float()[..., None]) / d.float().clamp_min(1e-12)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).view(out, n // GROUP, 2, GROUP // 2)                   # per block: weights j and j + 16
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out, n // 2)               # low nibble: j; high: j + 16
    return Q4Weight(packed, d, m)
