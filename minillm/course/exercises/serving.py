"""Notebook 11: reading a streamed answer off the wire, and the percentiles a serving benchmark reports."""
from __future__ import annotations

import json
import random

import numpy as np

from ..timing import percentile
from .check import Case, run_checks


def _stream(pieces: list[str], usage: bool) -> list[str]:
    """The lines of a /v1/completions stream, as the server writes them (blank lines between events)."""
    lines = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = {"id": "cmpl-1", "object": "text_completion", "model": "smollm2",
                 "choices": [{"index": 0, "text": text, "finish_reason": "length" if last else None}]}
        lines += [f"data: {json.dumps(chunk)}", ""]
    if usage:
        lines += [f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': {'completion_tokens': len(pieces)}})}", ""]
    return lines + ["data: [DONE]", ""]


def check_parse_sse(fn) -> bool:
    """fn(lines) -> the answer's text: each event's choices[0]["text"], joined, until data: [DONE]."""
    cases = []
    for name, pieces, usage in [(" 5, 6, 7, 8 in four chunks", [" 5", ",", " 6", ","], False),
                                ("with a usage chunk (no choices) before [DONE]", ["Hello", " there", "!"], True),
                                ("text with a newline and a quote", ["line 1\n", 'say "hi"'], True),
                                ("one chunk", ["ok"], False)]:
        def run(fn, pieces=pieces, usage=usage):
            lines = _stream(pieces, usage) + ["data: this line comes after [DONE] and must be ignored"]
            got = fn(list(lines))
            want = "".join(pieces)
            return None if got == want else f"got {got!r}, expected {want!r}"
        cases.append(Case(name, run))
    return run_checks(fn, cases, "your parser")


def check_percentile(fn) -> bool:
    """fn(values, q) -> the q-th percentile (0..100), linearly interpolated between sorted values."""
    rng = random.Random(1)
    samples = {"five values": [5.0, 1.0, 4.0, 2.0, 3.0], "one value": [0.25], "two values": [1.0, 3.0],
               "1,000 random ITLs with a long tail": [rng.expovariate(10) + (2.0 if rng.random() < 0.02 else 0)
                                                      for _ in range(1000)]}
    cases = []
    for name, values in samples.items():
        def run(fn, values=values):
            for q in (0, 25, 50, 90, 99, 100):
                want = percentile(values, q)
                got = fn(list(values), q)
                if got is None or abs(got - want) > 1e-9 * max(1.0, abs(want)):
                    return f"q = {q} of {values if len(values) < 8 else f'{len(values)} values'}: got {got}, " \
                           f"expected {want} (numpy: {np.percentile(values, q)})"
            return None
        cases.append(Case(f"{name}, q = 0, 25, 50, 90, 99, 100", run))
    return run_checks(fn, cases, "your percentile")
