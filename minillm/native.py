"""C kernels built on the learner's own machine: one C file each, compiled at first use, called with ctypes.

No torch headers and no build system. `load(source)` compiles the file once into a shared library in the
user's cache (`~/.cache/minillm/kernels`, keyed by the source, the compiler and this CPU) and loads it; the
caller hands it tensor data pointers. Flags are tried in turn, fastest first: `-march=native` (this CPU's
vector instructions) with OpenMP, without OpenMP (Apple's clang has none: one thread), then without
`-march=native`. Where no compiler works (Windows without a build toolchain, for one), or with
MINILLM_NO_CPU_KERNEL=1 set, `load` returns None and the caller keeps its torch path.

On Linux the library's OpenMP is the libgomp torch has already loaded, so torch and the kernels share one
pool of threads.

    attention/cpu_paged.c   paged decode attention, pages read in place (`attention/cpu_kernel.py`)
    matvec.c                a decode's few-row matrix products, streaming each weight once (`matvec.py`)
    c_block.c               a block's two halves around attention in one call each, for a few rows (`c_block.py`)
    vec.h                   what they include: one register of floats as one vector value (16, 8 or 4 of
                            them: AVX-512, AVX2, other CPUs), bfloat16 loads and stores
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

FLAG_SETS = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])
PACKAGE = Path(__file__).parent


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "minillm" / "kernels"


def compilers() -> list[str]:
    names = [os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    return list(dict.fromkeys(p for n in names if n and (p := shutil.which(n))))


def _build(source: Path, cc: str, flags: list[str]) -> Path | None:
    """The shared library for this source, compiler and CPU (built now unless cached), or None if cc fails."""
    headers = [h.read_bytes() for h in sorted([*PACKAGE.rglob("*.h"), *PACKAGE.rglob("*.c")])]   # what they include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, cc.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), torch.backends.cpu.get_cpu_capability().encode(),
                                     platform.processor().encode()])).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{key}{'.dll' if os.name == 'nt' else '.so'}"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:    # built aside, then moved: two builders race safely
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(tmp_lib), "-lm"]
        if subprocess.run(cmd, capture_output=True, timeout=120).returncode != 0:
            return None
        os.replace(tmp_lib, lib)
    return lib


@lru_cache(maxsize=None)
def load(source: Path) -> tuple[ctypes.CDLL, list[str]] | None:
    """(the library, the flags it was built with), or None where nothing builds."""
    if os.environ.get("MINILLM_NO_CPU_KERNEL"):
        return None
    for cc in compilers():
        for flags in FLAG_SETS:
            try:
                path = _build(source, cc, flags)
                if path:
                    return ctypes.CDLL(str(path)), flags
            except (OSError, subprocess.SubprocessError):
                continue
    return None
