"""The runner behind every exercise check: cases in, one line per case out."""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Case:
    name: str                          # what the case tries, in words
    run: Callable[[Callable], str | None]   # calls the learner's function; None if right, else what is wrong


def run_checks(fn: Callable, cases: list[Case], what: str) -> bool:
    """Run every case on fn; print ✓ or ✗ with the reason; True if all pass."""
    passed = 0
    for case in cases:
        try:
            problem = case.run(fn)
        except NotImplementedError:
            print(f"✗ {what} is not written yet: replace `raise NotImplementedError` with your code")
            return False
        except Exception as e:                               # the learner's bug: show where, not our frames
            frame = traceback.extract_tb(e.__traceback__)[-1]
            problem = f"raised {type(e).__name__}: {e} (line {frame.lineno}: {frame.line})"
        print(f"{'✓' if problem is None else '✗'} {case.name}" + ("" if problem is None else f": {problem}"))
        passed += problem is None
    print(f"{passed} of {len(cases)} checks pass" + (" — well done." if passed == len(cases) else "."))
    return passed == len(cases)


def learner_failed(e: Exception, what: str, doing: str) -> bool:
    """Say why a learner's function stopped a run inside the model or engine (not written yet, or where it
    raised); False. doing: how the line goes on, e.g. "inside the model, raised"."""
    if isinstance(e, NotImplementedError):
        print(f"✗ {what} is not written yet: replace `raise NotImplementedError` with your code")
    else:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        print(f"✗ {what}, {doing} {type(e).__name__}: {e} (line {frame.lineno}: {frame.line})")
    return False


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions and tensor methods a call runs (`with TorchCalls() as calls:`)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))
