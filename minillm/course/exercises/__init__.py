"""Checks for the course's exercises. Each `check_*` runs a learner's function on fresh, seeded cases
against minillm's own implementation, prints what is right and, for what is wrong, what was expected,
and returns True when everything passes. It never raises, so a notebook runs on to the next cell.

    notebook 01  check_rms_norm, check_causal_attention                  (model.py)
                 check_attention_in_model                                (in_model.py)
    notebook 02  check_top_p, check_min_p                                (sampling.py)
    notebook 03  check_kv_append, check_kv_bytes                         (kv_cache.py)
                 check_kv_append_in_model                                (in_model.py)
    notebook 04  check_gqa_decode                                      (gqa.py), check_ridge_batch (predict.py)
    notebook 05  check_online_softmax, check_merge_states                (flash.py)
                 check_online_tile_in_model                              (in_model.py)
                 check_decode_kernel, check_decode_kernel_in_model       (triton_decode.py: Triton)
    notebook 06  check_slot_lookup, check_blocks_needed                  (paged.py)
                 check_block_pool, check_block_pool_in_engine            (block_pool.py)
    notebook 07  check_decode_steps, check_schedule, check_pack          (engine.py)
                 check_schedule_in_engine                                (in_model.py)
    notebook 08  check_chunk_plan, check_chunk_mask                     (chunked.py)
    notebook 09  check_chain, check_cached_tokens, check_lru             (prefix.py)
    notebook 10  check_verify_greedy, check_accept_draft,
                 check_lookup_speedup                                    (speculative.py)
                 check_verify_in_engine                                  (in_model.py)
    notebook 11  check_parse_sse, check_percentile                       (serving.py)
    notebook 12  check_int8_rows, check_read_q4_1                  (quant.py)
    notebook 13  check_qkv_shard, check_transfer_bytes, check_ring_all_reduce (distributed.py)
    notebook 14  check_rope_interleaved, check_step_split                (step.py)

`check_prediction` (predict.py) serves the predict-a-number exercise of notebooks 01-03 and 05-14: the
learner's number against what the notebook measured in the same run.
"""
from .block_pool import check_block_pool, check_block_pool_in_engine
from .check import Case, run_checks
from .chunked import check_chunk_mask, check_chunk_plan
from .distributed import check_qkv_shard, check_ring_all_reduce, check_transfer_bytes
from .engine import check_decode_steps, check_pack, check_schedule
from .flash import check_merge_states, check_online_softmax
from .gqa import check_gqa_decode
from .in_model import (check_attention_in_model, check_kv_append_in_model, check_online_tile_in_model,
                       check_schedule_in_engine, check_verify_in_engine)
from .kv_cache import check_kv_append, check_kv_bytes
from .model import check_causal_attention, check_rms_norm
from .paged import check_blocks_needed, check_slot_lookup
from .predict import check_prediction, check_ridge_batch
from .prefix import check_cached_tokens, check_chain, check_lru
from .quant import check_read_q4_1, check_int8_rows
from .sampling import check_min_p, check_top_p
from .serving import check_parse_sse, check_percentile
from .speculative import check_accept_draft, check_lookup_speedup, check_verify_greedy
from .step import check_rope_interleaved, check_step_split
from .triton_decode import check_decode_kernel, check_decode_kernel_in_model

__all__ = [
    "Case", "check_accept_draft", "check_block_pool", "check_block_pool_in_engine", "check_attention_in_model", "check_blocks_needed", "check_cached_tokens", "check_causal_attention",
    "check_chain", "check_chunk_mask", "check_chunk_plan", "check_decode_kernel", "check_decode_kernel_in_model", "check_decode_steps", "check_read_q4_1",
    "check_gqa_decode", "check_int8_rows", "check_lookup_speedup", "check_kv_append", "check_kv_append_in_model", "check_kv_bytes", "check_lru", "check_merge_states",
    "check_min_p", "check_online_softmax", "check_online_tile_in_model", "check_pack", "check_parse_sse", "check_percentile", "check_prediction",
    "check_qkv_shard", "check_ridge_batch", "check_ring_all_reduce",
    "check_rms_norm", "check_rope_interleaved", "check_schedule", "check_schedule_in_engine", "check_slot_lookup", "check_step_split", "check_top_p",
    "check_transfer_bytes", "check_verify_greedy", "check_verify_in_engine", "run_checks",
]
