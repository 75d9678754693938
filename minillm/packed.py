"""Batched products through oneDNN's prepacked weights, for the engine's big steps on a CPU.

A decode step of 64 requests multiplies 64 rows by every weight: a tall-thin matrix product. `F.linear`
hands it to the BLAS with the weight as it lies (row-major, out x in), and the library re-reads it in the
order its inner kernel wants on every call. oneDNN (PyTorch's `mkldnn` operators) can reorder a weight
once into that blocked layout (`_reorder_linear_weight`) and then multiply straight from it
(`_linear_pointwise`): the same products, in float32, without the per-call reshuffle. What it costs is a
second copy of every weight it packs, kept beside the plain one (the C loops of `matvec.c` read a decode's
few rows from the plain one), so the engine asks for it (`pack_weights=True`; `python -m minillm serve`
does by default) and the notebooks, which hold several models at once, do not.

    race = pack_model(model)      time F.linear against packed weights on the model's own layers at 64 rows,
                                  taking turns; where packed wins by more than 5%, pack every float weight
                                  (of a dtype oneDNN packs on this CPU: `packs(dtype)`)
    linear(x, w)                  the packed product of x and w, or None where w has no (current) packing
    unpack_model(model)           drop them again

Packings are kept per weight tensor and dropped when it changes (a new tensor, or an in-place write).
"""
from __future__ import annotations

import statistics
import time
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F

MIN_ROWS = 9                  # fewer rows go to the C loops (`matvec.MAX_ROWS`) or stay with F.linear
DTYPES = (torch.float32, torch.bfloat16)
_packs: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its version when packed, the packed weight)


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


def keep(w: torch.Tensor) -> None:
    """Pack w and keep the packing for `linear`, until w is written in place or freed. (Not for a tensor made
    under `torch.inference_mode`: it does not count its in-place writes, so a stale packing would go unseen.)"""
    if w.is_inference():
        raise ValueError("an inference tensor does not count its in-place writes: pack a weight made outside "
                         "torch.inference_mode")
    key = id(w)
    _packs[key] = (weakref.ref(w, lambda _, key=key: _packs.pop(key, None)), w._version, pack(w))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x @ w^T through w's packing, or None where w has none, it is stale, or x is not for it (few rows,
    another dtype, autograd, torch.compile)."""
    kept = _packs.get(id(w))
    if kept is None or kept[0]() is not w or x.dtype != w.dtype or x.device.type != "cpu":
        return None
    if kept[1] != w._version:                             # written in place since it was packed
        _packs.pop(id(w), None)
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < MIN_ROWS or torch.is_grad_enabled() and w.requires_grad or torch.compiler.is_compiling():
        return None
    return product(x, kept[2])


def float_weights(model) -> list[torch.Tensor]:
    """The model's plain float weights that go through `matvec.linear` (its Linear layers and the tied head), in
    a dtype oneDNN packs on this CPU."""
    from .model import Linear
    ws = [m.weight for m in model.modules() if type(m) is Linear and m.bias is None]
    if "lm_head" not in model._modules:
        ws.append(model.tok_emb.weight)
    return [w for w in ws if packs(w.dtype) and w.device.type == "cpu" and w.dim() == 2 and not w.is_inference()]


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


def pack_model(model, force: bool = False) -> dict | None:
    """Pack the model's float weights where packed products measured faster at 64 rows, or whatever was
    measured with `force` (the result is kept in `model.packed`); None where oneDNN is missing or the model
    has no float weights on the CPU that it packs here (bfloat16 ones on an AVX2-only CPU)."""
    weights = float_weights(model)
    if not available() or not weights:
        return None
    result = race(weights)
    if result["use_packed"] or force:
        for w in weights:
            if _packs.get(id(w), (lambda: None,))[0]() is not w:
                keep(w)
    model.__dict__["packed"] = result
    return result


def unpack_model(model) -> None:
    """Drop the packings of the model's weights (their memory goes back)."""
    for w in float_weights(model):
        _packs.pop(id(w), None)
    model.__dict__.pop("packed", None)
