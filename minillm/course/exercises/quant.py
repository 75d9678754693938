"""Notebook 12: int8 with one scale per row, and reading the file's 4-bit (Q4_1) blocks."""
from __future__ import annotations

import torch

from ...quant.linear import Int8Linear, quantize_q4_1
from .check import Case, run_checks


def check_int8_rows(fn) -> bool:
    """fn(w (out, in) float32) -> (q int8 (out, in), scale float (out,)) with w ≈ q * scale[:, None]."""
    g = torch.Generator().manual_seed(4)
    weights = {"8 × 64 random weights": torch.randn(8, 64, generator=g),
               "rows of very different sizes": torch.randn(6, 32, generator=g) * torch.logspace(-3, 2, 6)[:, None],
               "a row of zeros": torch.cat([torch.zeros(1, 16), torch.randn(2, 16, generator=g)])}
    cases = []
    for name, w in weights.items():
        def run(fn, w=w):
            got = fn(w.clone())
            if not isinstance(got, tuple) or len(got) != 2:
                return "return a tuple (q, scale)"
            q, scale = got
            ref = Int8Linear.from_float(w, kernel=False)
            if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.shape != w.shape:
                return f"q must be an int8 tensor of shape {tuple(w.shape)}, got {getattr(q, 'dtype', type(q))} " \
                       f"{tuple(getattr(q, 'shape', ()))}"
            if tuple(scale.shape) != (w.shape[0],):
                return f"scale must have one value per row, shape ({w.shape[0]},), got {tuple(scale.shape)}"
            if not torch.allclose(scale.float(), ref.scale, rtol=1e-5, atol=1e-12):
                return f"scales {scale[:3].tolist()}, expected {ref.scale[:3].tolist()} (the row's largest |w| / 127)"
            if q.abs().max() > 127:
                return "a code is -128: keep the range symmetric, -127..127"
            err = (q.float() * scale.float()[:, None] - w).abs()
            if (err > ref.scale[:, None] / 2 * (1 + 1e-4) + 1e-12).any():
                r, c = (err > ref.scale[:, None] / 2 * (1 + 1e-4) + 1e-12).nonzero()[0].tolist()
                return f"w[{r}, {c}] = {w[r, c]:.5f} comes back as {float(q[r, c]) * float(scale[r]):.5f}: " \
                       "round to the nearest code"
            return None
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your int8 quantization")


def check_dequantize_q4_1(fn) -> bool:
    """fn(packed (out, in/2) uint8, d (out, in/32), m (out, in/32)) -> (out, in) float32, as llama.cpp reads Q4_1."""
    g = torch.Generator().manual_seed(6)
    cases = []
    for out, n in [(1, 32), (4, 96), (16, 256)]:
        w4 = quantize_q4_1(torch.randn(out, n, generator=g))

        def run(fn, w4=w4):
            want = w4.dequantize()
            got = fn(w4.packed.clone(), w4.scale.clone(), w4.min.clone())
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"expected shape {tuple(want.shape)}, got {tuple(getattr(got, 'shape', ()))}"
            if not torch.allclose(got.float(), want, atol=1e-6):
                wrong = (got.float() - want).abs().gt(1e-6).nonzero()[0].tolist()
                j = wrong[1] % 32
                hint = (" (weights 16..31 of a block are the high nibbles of its bytes 0..15)" if j >= 16 else
                        " (weight j of a block is the low nibble of its byte j)")
                return f"weight {tuple(wrong)}: got {float(got[wrong[0], wrong[1]]):.5f}, " \
                       f"expected {float(want[wrong[0], wrong[1]]):.5f}{hint}"
            return None
        cases.append(Case(f"{out} × {n} weights ({out * n // 32} blocks)", run))
    return run_checks(fn, cases, "your Q4_1 reader")
