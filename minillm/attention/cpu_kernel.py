"""The CPU's paged decode kernel (`cpu_paged.c`), built on this machine by `native.py`, called with ctypes.

Where it does not build, `available()` is False and the engine gathers pages for SDPA instead.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from .. import native

SOURCE = Path(__file__).with_name("cpu_paged.c")
MAX_HEAD_DIM = 256                             # the C file's MAX_DV vecs of 16
DTYPES = (torch.float32, torch.bfloat16)
PROFILER_NAME = "minillm::paged_attention_cpu"


@lru_cache(maxsize=1)
def load_library():
    """(ctypes library, flags it was built with), or None where nothing builds."""
    built = native.load(SOURCE)
    if built:
        f = built[0].paged_decode
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        f.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i32, i32, i32, i32, i32,
                      ctypes.c_float, i32, ptr, i64, i64, i32]
        f.restype = i32
    return built


def available() -> bool:
    return load_library() is not None


def supports(cache) -> bool:
    """Can the kernel read this cache? float32 or bfloat16 pages on the CPU, contiguous, head_dim a
    multiple of 16 up to 256 (int8/int4 caches and float16 go through gather + SDPA)."""
    if not isinstance(cache, torch.Tensor) or cache.device.type != "cpu" or cache.dtype not in DTYPES:
        return False
    d = cache.shape[-1]
    return cache.is_contiguous() and d % 16 == 0 and d <= MAX_HEAD_DIM and available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q, out (N, H, D) (any strides, last one 1); k_cache, v_cache (num_blocks, bs, H_kv, D);
    rows (n,) int64: the query row of each decode; table (n, W) int32; lens (n,) int32 -> out, rows filled."""
    lib, _ = load_library()
    _, bs, h_kv, d = k_cache.shape
    h = q.shape[1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.stride(-1) == 1 == out.stride(-1)
    assert table.dtype == lens.dtype == torch.int32 and rows.dtype == torch.int64 and table.is_contiguous()
    args = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            table.data_ptr(), table.shape[1], rows.data_ptr(), lens.data_ptr(), rows.numel(),
            bs, h, h_kv, d, d ** -0.5, int(q.dtype == torch.bfloat16),
            out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(PROFILER_NAME):
            rc = lib.paged_decode(*args)
    else:
        rc = lib.paged_decode(*args)
    if rc != 0:
        raise ValueError(f"the CPU paged kernel needs head_dim a multiple of 16 up to {MAX_HEAD_DIM} and query "
                         f"heads a multiple of the KV heads; got {h} heads over {h_kv}, head_dim {d}")
    return out
