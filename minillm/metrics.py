"""Timing helpers for notebooks and benchmarks: medians, never single runs."""
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
