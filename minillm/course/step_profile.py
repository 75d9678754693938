"""Where a step's time goes, four ways: matrix products, attention, everything else the device runs,
and Python (the interpreter between operators: the runner's packing, the scheduler, module calls).

    split = step_split(fn)     fn() runs one step; {"wall_ms", "matmul_ms", "attention_ms", "other_ms",
                               "python_ms", "ops_per_step", "top": [(op, ms), ...]} per step

torch.profiler records every operator with its own ("self") time. An operator counts as attention when
it is SDPA or runs inside it, the C paged kernel (`minillm::paged_attention_cpu`), or gathers pages (an
`index_select` outside the embedding); as a matrix product when it is one (mm, addmm, bmm, the 4- and
8-bit kernels, fbgemm's linear, oneDNN's packed `_linear_pointwise`, `minillm::matvec`, and
`minillm::c_block`: a block half in C, its products with the norm, RoPE or SiLU around them, and
`minillm::c_layer`: a whole block in C, the same with the cache write and attention, which at a decode's
short contexts is a small part of it); as other otherwise
(norms, RoPE, SiLU, dtype conversions, K/V writes, the output head's softmax...). What is left of the
wall time is Python. The profiler adds a few microseconds to every operator; the split is the profiled
run's, scaled to the median wall time of unprofiled runs (`profiler_slowdown` says by how much).

    bytes_per_token(model, context, kv)   what a decode step must read: weights + one sequence's K/V
"""
from __future__ import annotations

import re
import statistics
import time

from ..kv import kv_cache_bytes
from ..model import weight_bytes
from .timing import _quiet_stderr, run_times

MATMUL = re.compile(r"(^|::|_)(mm|addmm|bmm|baddbmm|matmul|linear|linear_dynamic|fbgemm_linear\w*|"
                    r"_weight_int4pack_mm\w*|_weight_int8pack_mm\w*|linear_prepack\w*|_linear_pointwise|"
                    r"matvec|c_block|c_layer)$")
ATTENTION = re.compile(r"scaled_dot_product|flash_attention|flex_attention|paged_attention_cpu")


def _category(event) -> str:
    """The category of an operator's self time, from it and the operators it runs inside."""
    chain, e = [], event
    while e is not None:
        chain.append(e.name)
        e = e.cpu_parent
    if any(ATTENTION.search(n) for n in chain):
        return "attention"
    if event.name == "aten::index_select" and "aten::embedding" not in chain:
        return "attention"                                          # the pages a request attends to
    if any(MATMUL.search(n) for n in chain):
        return "matmul"
    return "other"


def step_split(fn, repeats: int = 10, warmup: int = 3) -> dict:
    """The median wall time of fn() and the profiled split of its time into four parts, per call."""
    from torch.profiler import ProfilerActivity, profile

    walls = run_times(fn, repeats, warmup)                         # unprofiled: the true wall time
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        profiled_wall = (time.perf_counter() - t0) / repeats
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    by_op: dict[str, float] = {}
    ops = 0
    for e in prof.events():
        if e.device_type.name != "CPU" or e.name.startswith("ProfilerStep"):
            continue
        ms = e.self_cpu_time_total / 1e3 / repeats
        parts[_category(e)] += ms
        by_op[e.name] = by_op.get(e.name, 0.0) + ms
        ops += e.cpu_parent is None                                 # operators Python called
    wall = statistics.median(walls) * 1e3
    device = sum(parts.values())
    scale = wall / (profiled_wall * 1e3)                            # the profiler's own cost taken out
    split = {k + "_ms": v * scale for k, v in parts.items()}
    return {"wall_ms": wall, **split, "python_ms": max(wall - device * scale, 0.0),
            "ops_per_step": ops / repeats, "profiler_slowdown": 1 / scale,
            "top": sorted(((k, v * scale) for k, v in by_op.items()), key=lambda kv: -kv[1])[:12]}


def bytes_per_token(model, context: int, kv_dtype: str | None = None) -> int:
    """Bytes one single-stream decode step reads at least: every weight once and the K/V of `context` tokens."""
    return weight_bytes(model) + kv_cache_bytes(model.cfg, context, model.dtype, kv_dtype)
