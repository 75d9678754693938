"""Batched products through oneDNN's prepacked weights, for the engine's big steps on a CPU.

A decode step of 64 requests multiplies 64 rows by every weight: a tall-thin matrix product. `F.linear`
hands it to the BLAS with the weight as it lies (row-major, out x in), and the library re-reads it in the
order its inner kernel wants on every call. oneDNN (PyTorch's `mkldnn` operators) can reorder a weight
once into that blocked layout (`_reorder_linear_weight`) and then multiply straight from it
(`_linear_pointwise`): the same products, in float32, without the per-call reshuffle. What it costs is a
second copy of every weight it packs, kept beside the plain one (the C loops of `matvec.c` read a decode's
few rows from the plain one), so the native backend makes it only where asked (`pack_weights=True`;
`python -m minillm serve` does by default) and where it measured faster (`races.packed_products`).

    pack(w)              w in oneDNN's blocked layout (a copy)
    product(x, packed)   x @ W^T from it
    packs(dtype)         whether oneDNN packs this dtype on this CPU

The layer that holds a packing (`layers.CLinear`) drops it when its weight is written in place.
"""
from __future__ import annotations

import statistics
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether this PyTorch build has oneDNN's linear operators on this CPU."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


@lru_cache(maxsize=None)
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies weights of this dtype on this CPU. Its bfloat16 path needs
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU it refuses, and the weights stay plain."""
    if not available() or dtype not in DTYPES:
        return False
    w, x = torch.ones(16, 16, dtype=dtype), torch.ones(9, 16, dtype=dtype)
    try:
        return bool(torch.equal(product(x, pack(w)), F.linear(x, w)))
    except RuntimeError:
        return False


def pack(w: torch.Tensor) -> torch.Tensor:
    """w (out, in), float32 or bfloat16 on the CPU -> the same weight in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)


def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ W^T from a packed W -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def race(weights: list[torch.Tensor], rows: int = 64, rounds: int = 5) -> dict:
    """F.linear against packed weights over `weights` (one of each shape), `rows` rows, taking turns."""
    shapes = {}
    for w in weights:
        shapes.setdefault(tuple(w.shape), w)
    ws = list(shapes.values())
    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in ws]
    packs = [pack(w) for w in ws]
    times = {"torch": [], "packed": []}
    with torch.inference_mode():
        for r in range(rounds + 1):                       # the first round warms up
            for name in times:
                t0 = time.perf_counter()
                for x, w, p in zip(xs, ws, packs):
                    F.linear(x, w) if name == "torch" else product(x, p)
                if r:
                    times[name].append(time.perf_counter() - t0)
    t, p = statistics.median(times["torch"]), statistics.median(times["packed"])
    return {"rows": rows, "torch_ms": t * 1e3, "packed_ms": p * 1e3, "use_packed": p < t / 1.05}
