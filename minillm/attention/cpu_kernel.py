"""The CPU's paged decode kernel (`cpu_paged.c`), built on this machine by `cbuild.py`, called with ctypes.

Where it does not build, `available()` is False and the engine gathers pages for SDPA instead.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from .. import cbuild

SOURCE = Path(__file__).with_name("cpu_paged.c")
MAX_HEAD_DIM = 256                             # the C file's MAX_DV vecs of 16
DTYPES = (torch.float32, torch.bfloat16)
PROFILER_NAME = "minillm::paged_attention_cpu"


SIGNATURES = {"paged_decode": [
    ("q", "ptr"), ("sq_n", "i64"), ("sq_h", "i64"), ("k", "ptr"), ("v", "ptr"), ("table", "ptr"), ("width", "i32"),
    ("rows", "ptr"), ("lens", "ptr"), ("n", "i32"), ("bs", "i32"), ("h", "i32"), ("h_kv", "i32"), ("d", "i32"),
    ("scale", "f32"), ("bf16", "i32"), ("out", "ptr"), ("so_n", "i64"), ("so_h", "i64"), ("threads", "i32")]}


@lru_cache(maxsize=1)
def load_library() -> cbuild.Library | None:
    """The built kernel, or None where nothing builds."""
    return cbuild.load(SOURCE, SIGNATURES)


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
    lib = load_library()
    _, bs, h_kv, d = k_cache.shape
    h = q.shape[1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.stride(-1) == 1 == out.stride(-1)
    assert table.dtype == lens.dtype == torch.int32 and rows.dtype == torch.int64 and table.is_contiguous()
    args = dict(q=q.data_ptr(), sq_n=q.stride(0), sq_h=q.stride(1), k=k_cache.data_ptr(), v=v_cache.data_ptr(),
                table=table.data_ptr(), width=table.shape[1], rows=rows.data_ptr(), lens=lens.data_ptr(),
                n=rows.numel(), bs=bs, h=h, h_kv=h_kv, d=d, scale=d ** -0.5, bf16=int(q.dtype == torch.bfloat16),
                out=out.data_ptr(), so_n=out.stride(0), so_h=out.stride(1), threads=torch.get_num_threads())
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(PROFILER_NAME):
            rc = lib.call("paged_decode", **args)
    else:
        rc = lib.call("paged_decode", **args)
    if rc != 0:
        raise ValueError(f"the CPU paged kernel needs head_dim a multiple of 16 up to {MAX_HEAD_DIM} and query "
                         f"heads a multiple of the KV heads; got {h} heads over {h_kv}, head_dim {d}")
    return out
