"""Timing helpers for notebooks and benchmarks: medians, never single runs; latency percentiles."""
from __future__ import annotations

import statistics
import time

import torch

from ..memory import release_memory, return_freed_memory_to_the_os  # noqa: F401  (notebooks import them from here)


def sync(device=None) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def require_warmup(warmup: int) -> None:
    if warmup < 1:
        raise ValueError(f"warmup={warmup}: a first call pays one-time costs (allocation, lazy set-up, "
                         "a kernel's calibration or compilation), so every timing starts with at least one "
                         "untimed call")


def _time_call(fn, device=None) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def run_times(fn, repeats: int = 5, warmup: int = 1, device=None, before=None) -> list[float]:
    """Wall time of each of `repeats` calls of fn(), in seconds, after `warmup` (at least 1) untimed calls.
    before: called, untimed, before each call (e.g. `evict_caches`)."""
    require_warmup(warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        times.append(_time_call(fn, device))
    return times


def evict_caches(mib: int = 64) -> None:
    """Write and read `mib` MiB of other data, so that what the next timed call reads comes from memory and
    not from a CPU cache, as a decode step's weights do (they are far larger than any cache). The default is
    twice a 32 MiB last-level cache; the buffer is freed again at once."""
    torch.ones(mib << 18).amax()                                       # mib MiB of float32


def alternate(fns: dict, rounds: int = 5, warmup: int = 1, device=None) -> dict[str, list[float]]:
    """{name: seconds of each round} for several variants timed in turns: every variant is warmed up
    (`warmup` untimed calls each), then each round calls every variant once. A slow moment of the machine
    then hits all of them alike instead of one."""
    require_warmup(warmup)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time_call(fn, device))
    return times


def median_time(fn, repeats: int = 5, warmup: int = 1, device=None) -> float:
    """Median wall time of fn() in seconds, after `warmup` (at least 1) untimed calls."""
    return statistics.median(run_times(fn, repeats, warmup, device))


def spread(times: list[float], scale: float = 1e3, unit: str = "ms") -> str:
    """'41.2 ms (39.8-44.0 over 5 runs)': the median and the range, so a reader sees the noise."""
    return (f"{statistics.median(times) * scale:.1f} {unit} "
            f"({min(times) * scale:.1f}-{max(times) * scale:.1f} over {len(times)} runs)")


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


def _peak_by_high_water_mark(fn) -> int:
    """Linux: reset the kernel's high-water mark of resident memory, run fn, read it again. Exact."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                           # reset the high-water mark to the current size
    base = _rss_peak_kib()
    fn()
    return (_rss_peak_kib() - base) * 1024


def _peak_by_sampling(fn, interval_s: float = 0.001) -> int:
    """Anywhere (macOS, Windows): read resident memory every millisecond from a thread while fn runs.
    A spike shorter than the interval can be missed, so this may read a little low."""
    import threading

    import psutil

    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    done = threading.Event()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            done.wait(interval_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        fn()
    finally:
        done.set()
        watcher.join()
    return max(peak, proc.memory_info().rss) - base


def peak_memory_bytes(fn, method: str = "auto") -> int:
    """Peak extra resident memory while fn() runs: what torch really allocated, temporaries included.
    method "hwm" (Linux: the kernel's high-water mark, reset first, exact), "sample" (any OS: a thread
    reads the resident size every millisecond), or "auto" (the first that works here)."""
    return_freed_memory_to_the_os()
    if method in ("auto", "hwm"):
        try:
            return _peak_by_high_water_mark(fn)
        except OSError:
            if method == "hwm":
                raise
    return _peak_by_sampling(fn)


class _quiet_stderr:
    """Silence file descriptor 2 (C++ logging that Python's sys.stderr never sees) for a with-block."""

    def __enter__(self):
        import os
        import sys

        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        import os

        os.dup2(self.saved, 2)
        os.close(self.saved)


def profile_ops(fn, repeats: int = 5, warmup: int = 2) -> list[dict]:
    """What one call of fn() spends its time on, by PyTorch operation: [{"op", "calls", "self_ms"}] per call,
    largest first (torch.profiler's self time, so nested operations are not counted twice). The profiler
    adds a few microseconds to every operation, so many small ones read a little slow."""
    from torch.profiler import ProfilerActivity, profile

    require_warmup(warmup)
    for _ in range(warmup):
        fn()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:   # the profiler's C++ side
        for _ in range(repeats):                                                # logs start/stop lines
            fn()
    rows = [{"op": e.key, "calls": e.count / repeats, "self_ms": e.self_cpu_time_total / 1e3 / repeats}
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r["self_ms"])
