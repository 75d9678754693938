"""Checks for the course's exercises. Each `check_*` runs a learner's function on fresh, seeded cases
against minillm's own implementation, prints what is right and, for what is wrong, what was expected,
and returns True when everything passes. It never raises, so a notebook runs on to the next cell.

    notebook 01  check_rms_norm, check_causal_attention        (model.py)
    notebook 02  check_top_p, check_min_p                      (sampling.py)
    notebook 03  check_kv_append, check_kv_bytes               (kv_cache.py)
    notebook 04  check_repeat_kv, check_gqa_decode             (gqa.py)
    notebook 05  check_online_softmax, check_merge_splits      (flash.py)
    notebook 06  check_slot_lookup, check_blocks_needed        (paged.py)
"""
from .check import Case, run_checks
from .flash import check_merge_splits, check_online_softmax
from .gqa import check_gqa_decode, check_repeat_kv
from .kv_cache import check_kv_append, check_kv_bytes
from .model import check_causal_attention, check_rms_norm
from .paged import check_blocks_needed, check_slot_lookup
from .sampling import check_min_p, check_top_p

__all__ = ["Case", "check_blocks_needed", "check_causal_attention", "check_gqa_decode", "check_kv_append", "check_kv_bytes", "check_merge_splits",
           "check_min_p", "check_online_softmax", "check_repeat_kv", "check_rms_norm", "check_slot_lookup", "check_top_p",
           "run_checks"]
