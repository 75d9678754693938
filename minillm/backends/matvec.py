"""A decode step's matrix products on a CPU, in C: products that stream each weight once for a few rows
(`matvec.c`, built on this machine by `cbuild.py`).

A single-stream decode step multiplies one row by every weight matrix: each weight is used once, so the
product is as fast as the weights stream from memory (notebook 04). How fast torch's own kernel streams
them for one row depends on the CPU and the library behind it (on some CPUs a third of the copy bandwidth);
the C loop reads each weight row once from start to end, in the weight's own format:

    matvec(x2, w)                       float32 or bfloat16 weights
    matvec_int8(x2, q, scale)           int8 rows with one scale each (`Int8Linear`)
    matvec_q4_1(x2, *q4_tiles(...))     Q4_1 blocks (`Q4Linear`), laid out in tiles of 16 rows

Whether a layer uses them is measured when the native backend is applied (`races.py`); these functions
just multiply.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from .. import cbuild

SOURCE = Path(__file__).with_name("matvec.c")
MAX_ROWS = 8                                   # the C file's MAX_M: a few decodes, or one with its drafts
DTYPES = (torch.float32, torch.bfloat16)
PROFILER_NAME = "minillm::matvec"
_OUT = [("y", "ptr"), ("m", "i32"), ("N", "i64"), ("K", "i32"), ("bf16", "i32"), ("threads", "i32")]
SIGNATURES = {
    "matvec": [("x", "ptr"), ("w", "ptr"), *_OUT],
    "matvec_int8": [("x", "ptr"), ("w", "ptr"), ("scale", "ptr"), *_OUT],
    "matvec_q4_1": [("x", "ptr"), ("codes", "ptr"), ("d", "ptr"), ("mn", "ptr"), *_OUT],
}


@lru_cache(maxsize=1)
def load_library() -> cbuild.Library | None:
    return cbuild.load(SOURCE, SIGNATURES)


def _run(kernel: str, x2: torch.Tensor, y: torch.Tensor, K: int, **weight) -> torch.Tensor:
    args = dict(x=x2.data_ptr(), y=y.data_ptr(), m=x2.shape[0], N=y.shape[1], K=K,
                bf16=int(x2.dtype == torch.bfloat16), threads=torch.get_num_threads(), **weight)
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(PROFILER_NAME):
            rc = load_library().call(kernel, **args)
    else:
        rc = load_library().call(kernel, **args)
    assert rc == 0, f"{kernel}: shapes past the C loop's limits"
    return y


def matvec(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) contiguous, rows <= 8; w (out, in) contiguous, in % 16 == 0; same dtype -> (rows, out)."""
    y = torch.empty(x2.shape[0], w.shape[0], dtype=w.dtype)
    return _run("matvec", x2, y, w.shape[1], w=w.data_ptr())


def matvec_int8(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) float32 or bfloat16, contiguous, rows <= 8; q (out, in) int8, in % 16 == 0; scale (out,)
    float32 -> (rows, out) in x2's dtype: x2 @ (q * scale[:, None])^T."""
    y = torch.empty(x2.shape[0], q.shape[0], dtype=x2.dtype)
    return _run("matvec_int8", x2, y, q.shape[1], w=q.data_ptr(), scale=scale.data_ptr())


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
    y = torch.empty(x2.shape[0], tiles.shape[0] * 16, dtype=x2.dtype)
    return _run("matvec_q4_1", x2, y, tiles.shape[1] * 32, codes=tiles.data_ptr(), d=d.data_ptr(), mn=m.data_ptr())
