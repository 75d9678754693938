"""The timing races that choose the native backend's kernels, run when the backend is applied and never
inside a request, and remembered on disk.

Which product is faster on a CPU, torch's kernel or a C loop, and up to how many rows, depends on the CPU,
the library behind torch and the weight's format: it is measured, both sides taking turns, and a side is
chosen only where it wins by more than 5% (`MARGIN`, a setting, not a measurement):

    float_products(dtype)         one row and eight rows by 80 MB of weights shaped like the course model's
    quantized_products(layers)    the same, on a model's own int8 or Q4_1 layers
    packed_products(weights)      64 rows by each weight shape, F.linear against oneDNN's packed copy

A result holds for as long as what it measured stays the same: this CPU (its instruction sets), the torch
version, the C sources, the thread count and the shapes. It is kept under a key made of those in
`~/.cache/minillm/races/` (beside the built kernels), so a second process starts without racing.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from .. import cbuild
from . import matvec, packed

MARGIN = 0.95          # a side must take less than 95% of the other's time: faster by more than 5%


def race(fns: dict, rounds: int = 5) -> dict:
    """fns {"torch": f, "c": f}, f(rows) runs one side's products for that many rows. Both run at 1 row and at
    8 rows, taking turns: the median ms of each, and how many rows to give the C loop (`max_rows`): 8 if it
    is faster by more than 5% at both, 4 if only at one row, else 0."""
    ms = {}
    for rows in (1, 8):
        times = {k: [] for k in fns}
        for _ in range(rounds + 1):                              # the first round warms up
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn(rows)
                times[k].append(time.perf_counter() - t0)
        ms |= {f"{k}_ms_{rows}": statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    wins = {rows: ms[f"c_ms_{rows}"] < MARGIN * ms[f"torch_ms_{rows}"] for rows in (1, 8)}
    max_rows = 8 if wins[8] and wins[1] else 4 if wins[1] else 0
    return ms | {"use_c": wins[1], "max_rows": max_rows}


def machine() -> dict:
    """What a race's result depends on besides its own shapes."""
    return {"cpu": cbuild.cpu_key(), "torch": torch.__version__, "kernels": cbuild.sources_hash(),
            "threads": torch.get_num_threads()}


def cache_dir():
    return cbuild.cache_dir().parent / "races"


def remembered(name: str, what: dict, measure, remember: bool = True) -> dict:
    """measure() -> a result dict, run once for `what` on this machine and read back after (with
    "remembered": True); remember=False measures again (and keeps the new result)."""
    key = json.dumps({"race": name, **what, **machine()}, sort_keys=True)
    path = cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if remember and path.exists():
        try:
            return json.loads(path.read_text()) | {"remembered": True}
        except (OSError, ValueError):
            pass                                              # unreadable: measured again
    with torch.inference_mode():
        result = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    except OSError:
        pass                                                  # a read-only home: measured every time
    return result | {"remembered": False}


def float_products(dtype: torch.dtype, remember: bool = True, rounds: int = 5) -> dict | None:
    """torch against the C loop on one row and eight rows times 80 MB of weights (float32; 40 MB in
    bfloat16) shaped like the course model's layers: {torch_ms_1, c_ms_1, torch_ms_8, c_ms_8, bytes, use_c,
    max_rows}; None where the C loop does not build or does not take dtype."""
    if dtype not in matvec.DTYPES or matvec.load_library() is None:
        return None

    def measure():
        shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 6
        ws = [torch.full(s, 0.01, dtype=dtype) for s in shapes]
        xs = {(rows, k): torch.full((rows, k), 0.5, dtype=dtype) for rows in (1, 8) for k in (576, 1536)}
        fns = {"torch": lambda rows: [F.linear(xs[rows, w.shape[1]], w) for w in ws],
               "c": lambda rows: [matvec.matvec(xs[rows, w.shape[1]], w) for w in ws]}
        return race(fns, rounds) | {"bytes": sum(w.numel() * w.element_size() for w in ws)}

    return remembered("float_products", {"dtype": str(dtype)}, measure, remember)


def quantized_products(kind: str, layers: list, dtype: torch.dtype, remember: bool = True) -> dict:
    """The model's own C layers of one kind ("int8", "q4_1"), at 1 and 8 rows of `dtype` activations, with
    torch's kernels (c_rows = 0) and the C loops (c_rows = 8), taking turns (`race`)."""
    xs = {(rows, m.in_features): torch.randn(rows, m.in_features, dtype=dtype) for rows in (1, 8) for m in layers}

    def products(c_rows):
        def run(rows):
            for m in layers:
                m.c_rows = c_rows
                m(xs[rows, m.in_features])
        return run

    def measure():
        try:
            return race({"torch": products(0), "c": products(matvec.MAX_ROWS)})
        finally:
            for m in layers:
                m.c_rows = 0
    shapes = sorted({(m.out_features, m.in_features) for m in layers})
    return remembered("quantized_products", {"kind": kind, "dtype": str(dtype), "shapes": shapes}, measure, remember)


def packed_products(weights: list[torch.Tensor], remember: bool = True) -> dict:
    """F.linear against oneDNN's packed weights at 64 rows, one weight of each shape (`packed.race`)."""
    shapes = sorted({tuple(w.shape) for w in weights})
    what = {"dtype": str(weights[0].dtype), "shapes": shapes}
    return remembered("packed_products", what, lambda: packed.race(weights), remember)
