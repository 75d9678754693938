"""Timing helpers for notebooks and benchmarks: medians, never single runs; latency percentiles."""
from __future__ import annotations

import statistics
import time

import torch


def sync(device=None) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def median_time(fn, repeats: int = 5, warmup: int = 1, device=None) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) of values, linearly interpolated (numpy's default); None if empty."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(values) -> dict:
    """{"mean", "p50", "p90", "p99"} of latencies, as serving benchmarks report them (None if empty)."""
    values = [v for v in values if v is not None]
    mean = sum(values) / len(values) if values else None
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def _rss_peak_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise OSError("no VmHWM")


_libc = None


def _return_freed_memory_to_the_os() -> None:
    """glibc keeps freed memory for reuse, so an allocation can be served from pages the process
    already holds and a measurement would read low. A fixed mmap threshold makes large blocks go
    back to the OS when freed, and malloc_trim hands back what is free now."""
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: blocks above 64 KiB are mmapped, unmapped at free
            _libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_bytes(fn) -> int | None:
    """Peak extra resident memory while fn() runs (Linux: the kernel's high-water mark, reset first).
    Returns None where the OS does not offer it. Counts what torch really allocated, temporaries included."""
    _return_freed_memory_to_the_os()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                       # reset the high-water mark to the current size
        base = _rss_peak_kib()
        fn()
        return (_rss_peak_kib() - base) * 1024
    except OSError:
        return None
