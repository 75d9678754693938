"""Notebook 12: int8 with one scale per row, and reading the file's 4-bit (Q4_1) blocks from its bytes."""
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


def _raw_blocks(w4) -> torch.Tensor:
    """A Q4Weight back to the file's bytes: (out, blocks, 20) uint8, each block d, m (float16) then 16 bytes."""
    out, blocks = w4.scale.shape
    d = w4.scale.contiguous().view(torch.uint8).view(out, blocks, 2)
    m = w4.min.contiguous().view(torch.uint8).view(out, blocks, 2)
    return torch.cat([d, m, w4.packed.view(out, blocks, 16)], dim=-1)


def _q4_problem(got, want) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"expected shape {tuple(want.shape)}, got {tuple(getattr(got, 'shape', ()))}"
    if got.dtype != torch.float32:
        return f"return float32 weights, got {got.dtype}"
    if torch.equal(got, want):
        return None
    r, c = (got != want).nonzero()[0].tolist()
    j = c % 32
    if (got.view(-1, 32) != want.view(-1, 32)).all(-1).any():
        hint = " (a whole block is off: are d and m the float16 numbers in its first 4 bytes, in that order?)"
    elif j >= 16:
        hint = " (weights 16..31 of a block are the high nibbles of its bytes 0..15)"
    else:
        hint = " (weight j of a block is the low nibble of its byte j)"
    return f"weight {(r, c)}: got {float(got[r, c]):.6f}, expected {float(want[r, c]):.6f}{hint}"


def check_read_q4_1(fn) -> bool:
    """fn(raw (out, blocks, 20) uint8, the file's bytes) -> (out, blocks * 32) float32, as llama.cpp reads Q4_1;
    then every Q4_1 tensor of the course model's file, bit for bit against the `gguf` package's reader."""
    g = torch.Generator().manual_seed(6)
    cases = []
    for out, n in [(1, 32), (4, 96), (16, 256)]:
        w4 = quantize_q4_1(torch.randn(out, n, generator=g))
        cases.append(Case(f"{out} × {n} random weights ({out * n // 32} blocks)",
                          lambda fn, w4=w4: _q4_problem(fn(_raw_blocks(w4).clone()), w4.dequantize())))

    def whole_file(fn):
        import gguf
        import numpy as np

        from ...weights import find_model, tensor_index
        path = find_model().resolve()
        tensors = [t for t in tensor_index(path) if t[1].name == "Q4_1"]   # the bytes are read below, not mapped
        with open(path, "rb") as f:
            for name, kind, (n_in, n_out), offset, n_bytes in tensors:
                f.seek(offset)
                data = np.frombuffer(f.read(n_bytes), dtype=np.uint8)                # the tensor's bytes, as stored
                raw = torch.from_numpy(data.reshape(n_out, n_in // 32, 20).copy())
                want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32)
                                        .reshape(n_out, n_in))
                if problem := _q4_problem(fn(raw), want):
                    return f"{name}: {problem}"
        print(f"  all {len(tensors)} of the file's Q4_1 tensors read, bit for bit the weights the model runs with")
        return None
    cases.append(Case("every Q4_1 tensor of the course model's file", whole_file))
    return run_checks(fn, cases, "your Q4_1 reader")
