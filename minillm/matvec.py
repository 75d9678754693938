"""A decode step's matrix products on a CPU: `linear(x, w)`, F.linear that streams each weight once for a
few rows (`matvec.c`, built on this machine by `native.py`).

A single-stream decode step multiplies one row by every weight matrix: each weight is used once, so the
product is as fast as the weights stream from memory (notebook 04). How fast torch's own kernel streams
them for one row depends on the CPU and the library behind it (on some CPUs a third of the copy bandwidth);
the C loop reads each weight row once from start to end. Which of the two a process uses is chosen by
measurement, once per dtype, the first time it is asked: both multiply one row, then eight, by 80 MB of
weights shaped like the course model's, taking turns, and the C loop is used only where it is faster by more
than 5%: up to 8 rows if it wins at 8, else up to 4 if it wins at 1 (`choice()` says what was measured).
Everything else (more rows, other dtypes, another device, autograd, torch.compile) goes to F.linear, or,
for many rows, to the weight's oneDNN packing where an engine made one (`packed.py`).

    with matvec.using("torch"): ...     force one side ("c", "torch", or "auto"), to compare them
"""
from __future__ import annotations

import ctypes
import statistics
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native, packed

SOURCE = Path(__file__).with_name("matvec.c")
MAX_ROWS = 8                                   # the C file's MAX_M: a few decodes, or one with its drafts
DTYPES = (torch.float32, torch.bfloat16)
PROFILER_NAME = "minillm::matvec"
_mode = "auto"
_choice: dict[torch.dtype, dict] = {}


@lru_cache(maxsize=1)
def load_library():
    built = native.load(SOURCE)
    if built:
        lib, ptr, i32, i64 = built[0], ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.matvec.argtypes = [ptr, ptr, ptr, i32, i64, i32, i32, i32]
        lib.matvec_int8.argtypes = [ptr, ptr, ptr, ptr, i32, i64, i32, i32, i32]
        lib.matvec_q4_1.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i64, i32, i32, i32]
        for f in (lib.matvec, lib.matvec_int8, lib.matvec_q4_1):
            f.restype = i32
    return built


def _run(kernel: str, *args) -> None:
    f = getattr(load_library()[0], kernel)
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(PROFILER_NAME):
            rc = f(*args)
    else:
        rc = f(*args)
    assert rc == 0, f"{kernel}: shapes past the C loop's limits"


def matvec(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) contiguous, rows <= 8; w (out, in) contiguous, in % 16 == 0; same dtype -> (rows, out)."""
    y = torch.empty(x2.shape[0], w.shape[0], dtype=w.dtype)
    _run("matvec", x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.shape[0], w.shape[0], w.shape[1],
         int(w.dtype == torch.bfloat16), torch.get_num_threads())
    return y


def matvec_int8(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) float32 or bfloat16, contiguous, rows <= 8; q (out, in) int8, in % 16 == 0; scale (out,)
    float32 -> (rows, out) in x2's dtype: x2 @ (q * scale[:, None])^T."""
    y = torch.empty(x2.shape[0], q.shape[0], dtype=x2.dtype)
    _run("matvec_int8", x2.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), x2.shape[0], q.shape[0],
         q.shape[1], int(x2.dtype == torch.bfloat16), torch.get_num_threads())
    return y


def q4_tiles(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_1 weights in the C loop's layout (see `tile_q4_1` in matvec.c): codes (out, in) 0..15 in weight
    order, d and m (out, in / 32) -> tiles (out / 16, in / 32, 16, 16) uint8 (per tile of 16 rows and block:
    byte [p][r] holds row r's weights 2p and 2p + 1), d and m (out / 16, in / 32, 16) float16. out % 16 == 0."""
    n, k = codes.shape
    c = codes.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)       # (tile, block, p, row, 2)
    tiles = (c[..., 0] | (c[..., 1] << 4)).contiguous()
    per_tile = lambda s: s.view(n // 16, 16, k // 32).transpose(1, 2).contiguous().half()   # noqa: E731
    return tiles, per_tile(d), per_tile(m)


def matvec_q4_1(x2: torch.Tensor, tiles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) float32 or bfloat16, contiguous, rows <= 8; a Q4_1 weight laid out by `q4_tiles`
    -> (rows, out) in x2's dtype."""
    n = tiles.shape[0] * 16
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype)
    _run("matvec_q4_1", x2.data_ptr(), tiles.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), x2.shape[0],
         n, tiles.shape[1] * 32, int(x2.dtype == torch.bfloat16), torch.get_num_threads())
    return y


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
    wins = {rows: ms[f"c_ms_{rows}"] < 0.95 * ms[f"torch_ms_{rows}"] for rows in (1, 8)}
    max_rows = 8 if wins[8] and wins[1] else 4 if wins[1] else 0
    return ms | {"use_c": wins[1], "max_rows": max_rows}


def _measure(dtype: torch.dtype, rounds: int = 5) -> dict:
    """One row and eight rows times 80 MB of weights (float32; 40 MB in bfloat16) shaped like the course
    model's layers, torch and the C loop taking turns (`race`)."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 6
    ws = [torch.full(s, 0.01, dtype=dtype) for s in shapes]
    xs = {(rows, k): torch.full((rows, k), 0.5, dtype=dtype) for rows in (1, 8) for k in (576, 1536)}
    fns = {"torch": lambda rows: [F.linear(xs[rows, w.shape[1]], w) for w in ws],
           "c": lambda rows: [matvec(xs[rows, w.shape[1]], w) for w in ws]}
    return race(fns, rounds) | {"bytes": sum(w.numel() * w.element_size() for w in ws)}


def choice(dtype: torch.dtype = torch.float32) -> dict | None:
    """What this process measured for dtype ({torch_ms_1, c_ms_1, torch_ms_8, c_ms_8, bytes, use_c,
    max_rows}), measuring now if it has not; None where the C loop does not build or does not take dtype."""
    if dtype not in DTYPES or load_library() is None:
        return None
    if dtype not in _choice:
        with torch.inference_mode():
            _choice[dtype] = _measure(dtype)
    return _choice[dtype]


@contextmanager
def using(mode: str):
    """"c", "torch" or "auto" (the measured choice) inside the block."""
    global _mode
    if mode not in ("auto", "c", "torch"):
        raise ValueError(f"matvec mode must be 'auto', 'c' or 'torch'; got {mode!r}")
    old, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = old


def _use_c(dtype: torch.dtype, rows: int) -> bool:
    if _mode == "torch" or dtype not in DTYPES or load_library() is None:
        return False
    return _mode == "c" or rows <= choice(dtype)["max_rows"]


def use_c_for(x2: torch.Tensor, max_rows: int) -> bool:
    """Whether a quantized layer's product of x2 (rows, in) goes to the C loop: a CPU tensor of float32 or
    bfloat16 with at most `max_rows` rows (what `race` measured on the layer's model), or as `using` forces."""
    rows = x2.shape[0]
    if (_mode == "torch" or not 0 < rows <= MAX_ROWS or x2.device.type != "cpu" or x2.dtype not in DTYPES
            or torch.compiler.is_compiling() or load_library() is None):
        return False
    return _mode == "c" or rows <= max_rows


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias): x (..., in), w (out, in) -> (..., out)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == w.dtype and w.shape[1] % 16 == 0
            and w.is_contiguous() and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and w.requires_grad) and _use_c(w.dtype, rows)):
        return matvec(x.reshape(rows, -1).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    out = packed.linear(x, w) if packed._packs else None               # many rows: the engine's packed weights
    return F.linear(x, w) if out is None else out
