"""Checks for the course's exercises. Each `check_*` runs a learner's function on fresh, seeded cases
against minillm's own implementation, prints what is right and, for what is wrong, what was expected,
and returns True when everything passes. It never raises, so a notebook runs on to the next cell."""
from .check import Case, run_checks
from .sampling import check_min_p, check_top_p

__all__ = ["Case", "check_min_p", "check_top_p", "run_checks"]
