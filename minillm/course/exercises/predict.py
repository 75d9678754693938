"""Predict-a-number exercises: turn a formula and this machine's measured rates into a number, then see
how far it lands from a measurement made after the prediction (the notebook hands `check_prediction` the
function that measures, not the number, so nothing printed before the exercise gives the answer away).
A prediction passes within a factor of 1.3 unless the exercise states another: a model of a machine is
judged by its size and its terms, and the miss is explained below the answer."""
from __future__ import annotations

from .check import Case, run_checks


def check_prediction(fn, args: dict, measure, what: str, factor: float = 1.3, unit: str = "") -> bool:
    """fn(**args) -> a number; right when within `factor` of the measurement either way. `measure` is a
    function that measures the number, called only once fn has answered (or, where the number cannot be
    measured here, as for a committed GPU run, the number itself)."""
    def run(fn):
        got = float(fn(**args))
        if not got > 0:
            return f"a prediction of {got:.4g} cannot be right: {what} is positive"
        measured = float(measure() if callable(measure) else measure)
        ratio = got / measured
        print(f"  you predicted {got:.4g}{unit}; measured {measured:.4g}{unit} ({ratio:.2f}x)")
        if not 1 / factor <= ratio <= factor:
            return f"more than {factor:g}x off: check the formula's terms and units"
        return None
    return run_checks(fn, [Case(f"{what}, within {factor:g}x of the measurement", run)], f"your prediction of {what}")


def ridge_batch(peak_flops: float, bandwidth: float, bytes_per_weight: float) -> float:
    """The decode batch where a step's arithmetic intensity (2 FLOPs per weight per sequence, over the
    weight's bytes) reaches the machine's peak / bandwidth: past it, decode is compute-bound."""
    return peak_flops / bandwidth * bytes_per_weight / 2


def check_ridge_batch(fn, peak_flops: float, bandwidth: float, bytes_per_weight: float = 4) -> bool:
    """fn(peak_flops, bandwidth, bytes_per_weight) -> the ridge batch size, on this machine and on others."""
    machines = [("this CPU, float32", peak_flops, bandwidth, bytes_per_weight),
                ("an H200 in bfloat16 (data sheet: 989 TFLOP/s dense, 4.8 TB/s)", 989e12, 4.8e12, 2),
                ("a laptop, float32 (made-up: 200 GFLOP/s, 50 GB/s)", 200e9, 50e9, 4)]
    cases = []
    for name, peak, bw, b in machines:
        def run(fn, peak=peak, bw=bw, b=b):
            got, want = float(fn(peak, bw, b)), ridge_batch(peak, bw, b)
            return None if abs(got - want) <= 0.02 * want else f"got B = {got:.4g}, expected {want:.4g}"
        if "this CPU" not in name:                         # its number moves from run to run: printed elsewhere
            name = f"{name}: ridge at B = {ridge_batch(peak, bw, b):.0f}"
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your ridge batch size")
