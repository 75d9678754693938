"""Giving memory back to the operating system after large temporary copies (glibc only; elsewhere no-ops)."""
from __future__ import annotations


def return_freed_memory_to_the_os() -> None:
    """glibc keeps freed memory for reuse, so an allocation can be served from pages the process
    already holds and a measurement would read low, and a process that builds many large objects one
    after another creeps up in memory. A fixed mmap threshold makes blocks above 64 KiB go back to the
    OS when freed (set once, for the rest of the process: allocations get a little slower, so time
    kernels before calling it), and release_memory hands back what is free now (glibc only)."""
    global _thresholds_set
    if not _thresholds_set:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: blocks above 64 KiB are mmapped, unmapped at free
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        except (OSError, AttributeError):
            pass
        _thresholds_set = True
    release_memory()


_thresholds_set = False


def release_memory() -> None:
    """Collect garbage and hand the memory glibc keeps for reuse back to the OS (malloc_trim; elsewhere a
    no-op), so a process that loaded a model does not go on holding the temporary copies."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
