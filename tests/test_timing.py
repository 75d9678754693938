"""Every timing helper warms up before it times: a first call (allocation, lazy set-up, a kernel's
calibration or compilation) is never inside a timed region."""
import re
import time
from pathlib import Path

import pytest
import torch

from minillm.course.step_profile import step_split
from minillm.course.timing import alternate, median_time, profile_ops, run_times

ROOT = Path(__file__).resolve().parents[1]
SLOW_FIRST_S = 0.3


def slow_first_call():
    """A function whose first call pays a one-time cost of SLOW_FIRST_S seconds, like a lazy set-up."""
    state = {"calls": 0}

    def fn():
        state["calls"] += 1
        if state["calls"] == 1:
            time.sleep(SLOW_FIRST_S)
        return torch.ones(8, 8) @ torch.ones(8, 8)
    return fn, state


def test_run_times_and_median_time_leave_the_first_call_out():
    fn, state = slow_first_call()
    assert max(run_times(fn, repeats=3)) < SLOW_FIRST_S / 3
    assert state["calls"] == 4
    fn, _ = slow_first_call()
    assert median_time(fn, repeats=1) < SLOW_FIRST_S / 3


def test_alternate_warms_every_variant_then_takes_turns():
    a, a_state = slow_first_call()
    b, b_state = slow_first_call()
    order = []
    times = alternate({"a": lambda: (order.append("a"), a()), "b": lambda: (order.append("b"), b())}, rounds=3)
    assert set(times) == {"a", "b"} and all(len(ts) == 3 for ts in times.values())
    assert max(max(ts) for ts in times.values()) < SLOW_FIRST_S / 3
    assert order == ["a", "b"] * 4                      # one untimed call each, then three rounds in turn
    assert a_state["calls"] == b_state["calls"] == 4


def test_step_split_times_after_its_warmup():
    fn, state = slow_first_call()
    split = step_split(fn, repeats=2, warmup=1)
    assert split["wall_ms"] < SLOW_FIRST_S * 1e3 / 3
    assert state["calls"] == 1 + 2 + 2                 # warm-up, timed, profiled


def test_profile_ops_profiles_after_its_warmup():
    fn, state = slow_first_call()
    rows = profile_ops(fn, repeats=2, warmup=1)
    assert state["calls"] == 3 and any("mm" in r["op"] for r in rows)


@pytest.mark.parametrize("helper", [
    lambda: run_times(lambda: None, warmup=0),
    lambda: median_time(lambda: None, warmup=0),
    lambda: alternate({"a": lambda: None}, warmup=0),
    lambda: profile_ops(lambda: None, warmup=0),
    lambda: step_split(lambda: None, warmup=0),
])
def test_no_timing_helper_times_without_a_warmup(helper):
    with pytest.raises(ValueError, match="untimed call"):
        helper()


def test_nothing_asks_a_helper_to_skip_its_warmup():
    """The course, the engine's benchmarks and the notebooks never pass warmup=0 (or False)."""
    files = [*ROOT.glob("minillm/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("notebooks/*.ipynb")]
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
                 for m in re.finditer(r"warmup\s*=\s*(0|False)\b", p.read_text())]
    assert not offenders, offenders


def test_run_times_calls_before_outside_the_timed_region():
    """`before` (evicting the caches, say) runs before every timed call and is not in its time."""
    import time

    from minillm.course.timing import evict_caches, run_times

    calls = []
    times = run_times(lambda: calls.append("fn"), repeats=3, before=lambda: (calls.append("before"), time.sleep(0.2)))
    assert calls == ["fn", "before", "fn", "before", "fn", "before", "fn"]     # one warm-up call first
    assert max(times) < 0.1
    evict_caches(mib=4)                                                        # reads its buffer; returns nothing


def test_a_trace_split_accounts_for_every_microsecond_of_the_stepping_thread():
    """benchmarks/step_split_vllm.py: the parts of a split add up to the wall. Python that runs inside a named
    region (vLLM's record_function spans) is Python, not lost between the operators and the gaps."""
    from helpers.benchmark_script import load_benchmark

    split = load_benchmark("step_split_vllm").split
    events = [{"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 60, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 120, "dur": 30, "pid": 1, "tid": 1}]
    parts = split(events, tokens=1)["ms_per_token"]              # a span of 150 us: 60 mm, 30 add, 60 Python
    assert parts["matmul"] == 0.06 and parts["other ops"] == 0.03
    assert abs(parts["python and waiting"] - 0.06) < 1e-12      # 40 us inside the region, 20 us between the ops
    assert abs(sum(parts.values()) - 0.15) < 1e-12
