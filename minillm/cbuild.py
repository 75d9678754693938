"""C kernels built on the learner's own machine: one C file each, compiled at first use, called with ctypes.

No torch headers and no build system. `load(source, signatures)` compiles the file once into a shared library
in the user's cache (`~/.cache/minillm/kernels`) and loads it; the caller hands it tensor data pointers, by
name (`Library.call`). Flags are tried in turn, fastest first: `-march=native` (this CPU's vector
instructions) with OpenMP, without OpenMP (Apple's clang has none: one thread), then without `-march=native`.

A build is kept under a key made of what makes it valid: the C sources, the compiler and its version, the
flags, and this CPU's instruction sets (two CPUs sharing a home directory never share a `-march=native`
build). A build that fails is remembered under the same key and not tried again; where nothing builds
(macOS without the command-line tools, Windows without a C compiler) or with MINILLM_NO_CPU_KERNEL=1 set,
`load` returns None, one line says so, and the caller keeps its torch path.

On Linux the library's OpenMP is the libgomp torch has already loaded, so torch and the kernels share one
pool of threads.

    attention/cpu_paged.c       paged decode attention, pages read in place (`attention/cpu_kernel.py`)
    backends/matvec.c           a decode's few-row matrix products, streaming each weight once
    backends/c_block.c          a block's two halves around attention in one call each, for a few rows
    vec.h                       what they include: one register of floats as one vector value (16, 8 or 4 of
                                them: AVX-512, AVX2, other CPUs), bfloat16 loads and stores
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

FLAG_SETS = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])
PACKAGE = Path(__file__).parent
HOW_TO_GET_ONE = {"darwin": "xcode-select --install", "win32": "install LLVM's clang or MinGW-w64's gcc and put "
                  "it on PATH", "linux": "install gcc (apt install gcc, dnf install gcc)"}

# ctypes types by the names the signatures use
TYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "minillm" / "kernels"


def compilers() -> list[str]:
    names = [os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    return list(dict.fromkeys(p for n in names if n and (p := shutil.which(n))))


@lru_cache(maxsize=1)
def cpu_key() -> str:
    """This CPU's architecture and instruction sets, as torch's cpuinfo reads them (the same on every OS)."""
    caps = torch.cpu.get_capabilities()
    flags = sorted(k for k, v in caps.items() if v is True)
    return f"{platform.machine()} {caps.get('cpu_name', '')} {' '.join(flags)}"


@lru_cache(maxsize=None)
def compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def sources_hash() -> str:
    """Every C file and header of the package: a change to any of them makes every build new."""
    files = sorted([*PACKAGE.rglob("*.h"), *PACKAGE.rglob("*.c")])
    return hashlib.sha256(b"\0".join(f.read_bytes() for f in files)).hexdigest()[:16]


def build_key(source: Path, cc: str, flags: list[str]) -> str:
    """The key of a build: the source itself (a file of the same name elsewhere, say an older version of a
    kernel built to race it, is another build), the package's C files, the compiler, the flags, the CPU."""
    own = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    parts = [source.name, own, sources_hash(), cc, compiler_version(cc), " ".join(flags), cpu_key()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build(source: Path, cc: str, flags: list[str]) -> Path | None:
    """The shared library for this source, compiler, flags and CPU (built now unless cached), or None if it
    failed, now or at an earlier try with the same key (`<name>.failed` holds the compiler's message)."""
    key = build_key(source, cc, flags)
    lib = cache_dir() / f"{source.stem}-{key}{'.dll' if os.name == 'nt' else '.so'}"
    failed = lib.with_suffix(".failed")
    if lib.exists():
        return lib
    if failed.exists():
        return None
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:    # built aside, then moved: two builders race safely
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(tmp_lib), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            error = done.stderr.strip() if done.returncode else ""
        except (OSError, subprocess.SubprocessError) as e:
            error = str(e)
        if error or not tmp_lib.exists():
            failed.write_text(error or "no library written")
            return None
        os.replace(tmp_lib, lib)
    return lib


def _open(path: Path) -> ctypes.CDLL | None:
    """The library at path, or None where it does not load (a truncated or foreign file: deleted, to be
    built again)."""
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return None


class Library:
    """A built C file: its functions, called with named arguments in the order of their signatures.

        lib.call("matvec", x=..., w=..., y=..., m=1, N=960, K=576, bf16=0, threads=2) -> the int it returns
    """

    def __init__(self, cdll: ctypes.CDLL, flags: list[str], signatures: dict[str, list[tuple[str, str]]]):
        self.cdll, self.flags, self.signatures = cdll, flags, signatures
        self.functions = {}
        for name, args in signatures.items():
            f = getattr(cdll, name)
            f.argtypes = [TYPES[t] for _, t in args]
            f.restype = ctypes.c_int
            self.functions[name] = (f, tuple(a for a, _ in args))

    def call(self, name: str, **args) -> int:
        f, order = self.functions[name]
        if len(args) != len(order) or any(a not in args for a in order):    # (a decode step makes 60 calls)
            missing, extra = set(order) - set(args), set(args) - set(order)
            raise TypeError(f"{name}: missing {sorted(missing)}, unexpected {sorted(extra)}")
        return f(*[args[a] for a in order])


@lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    print(message, file=sys.stderr)


@lru_cache(maxsize=None)
def _load(source: Path) -> tuple[ctypes.CDLL, list[str]] | None:
    if os.environ.get("MINILLM_NO_CPU_KERNEL"):
        return None
    tried = compilers()
    for cc in tried:
        for flags in FLAG_SETS:
            path = _build(source, cc, flags)
            if path is None:
                continue
            cdll = _open(path) or (_open(path) if _build(source, cc, flags) else None)   # a corrupt file: rebuilt once
            if cdll is not None:
                return cdll, flags
    how = HOW_TO_GET_ONE.get(sys.platform, "install a C compiler")
    if tried:
        why = f"{', '.join(Path(c).name for c in tried)} failed to build {source.name}"
    else:
        why = "no C compiler on PATH (cc, gcc, clang or $CC)"
    _say_once(f"minillm: {why}; the torch kernels are used instead (for the C kernels: {how})")
    return None


def load(source: Path, signatures: dict[str, list[tuple[str, str]]]) -> Library | None:
    """The built C file with its functions typed by `signatures` {name: [(argument, "ptr"|"i32"|"i64"|"f32")]},
    or None where nothing builds (said once per process)."""
    built = _load(Path(source))
    return None if built is None else Library(built[0], built[1], signatures)
