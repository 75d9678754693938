"""The CPU's paged decode kernel (`cpu_paged.c`): built here with this machine's C compiler, called with ctypes.

No torch headers and no build system: one C file, compiled once into a shared library in the user's cache
(`~/.cache/minillm/kernels`, keyed by the source, the compiler and this CPU), loaded with ctypes and handed
tensor data pointers. Flags are tried in turn, fastest first: `-march=native` with OpenMP, without OpenMP
(Apple's clang has none: one thread), then without `-march=native`. Where no compiler works (Windows
without a build toolchain, for one), or with MINILLM_NO_CPU_KERNEL=1 set, `available()` is False and the
engine gathers pages for SDPA instead.
The library's OpenMP is the libgomp torch has already loaded on Linux, so torch and the kernel share one
thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged.c")
FLAG_SETS = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])
MAX_HEAD_DIM = 256                             # the C file's MAX_DV vecs of 16
DTYPES = (torch.float32, torch.bfloat16)
PROFILER_NAME = "minillm::paged_attention_cpu"


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "minillm" / "kernels"


def compilers() -> list[str]:
    names = [os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    return list(dict.fromkeys(p for n in names if n and (p := shutil.which(n))))


def _build(cc: str, flags: list[str]) -> Path | None:
    """The shared library for this source, compiler and CPU (built now unless cached), or None if cc fails."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cc.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), torch.backends.cpu.get_cpu_capability().encode(),
                                     platform.processor().encode()])).hexdigest()[:16]
    lib = cache_dir() / f"cpu_paged-{key}{'.dll' if os.name == 'nt' else '.so'}"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:          # built aside, then moved: two builders race safely
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, "-O3", "-shared", "-fPIC", *flags, str(SOURCE), "-o", str(tmp_lib), "-lm"]
        if subprocess.run(cmd, capture_output=True, timeout=120).returncode != 0:
            return None
        os.replace(tmp_lib, lib)
    return lib


@lru_cache(maxsize=1)
def load_library():
    """(ctypes library, flags it was built with), or None where nothing builds."""
    if os.environ.get("MINILLM_NO_CPU_KERNEL"):
        return None
    for cc in compilers():
        for flags in FLAG_SETS:
            try:
                path = _build(cc, flags)
                lib = path and ctypes.CDLL(str(path))
            except (OSError, subprocess.SubprocessError):
                continue
            if lib:
                f = lib.paged_decode
                i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
                f.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i32, i32, i32, i32, i32,
                              ctypes.c_float, i32, ptr, i64, i64, i32]
                f.restype = i32
                return lib, flags
    return None


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
    with torch.profiler.record_function(PROFILER_NAME):          # seen by torch.profiler as one operator
        rc = lib.paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                              table.data_ptr(), table.shape[1], rows.data_ptr(), lens.data_ptr(), rows.numel(),
                              bs, h, h_kv, d, d ** -0.5, int(q.dtype == torch.bfloat16),
                              out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the CPU paged kernel needs head_dim a multiple of 16 up to {MAX_HEAD_DIM} and query "
                         f"heads a multiple of the KV heads; got {h} heads over {h_kv}, head_dim {d}")
    return out
