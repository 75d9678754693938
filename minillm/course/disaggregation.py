"""Disaggregation measured, for notebook 13 and benchmarks/disaggregation.py: the bytes a prompt's hand-over
moves (`transfer_bytes`), and the baseline the disaggregated run is compared with: the same requests on one
engine that prefills and decodes in the same steps (`colocated_run`). The hand-over itself is
`minillm/distributed/disaggregated.py`."""
from __future__ import annotations

import time

import torch

from ..distributed.disaggregated import _result, _timed_step


def transfer_bytes(cfg, prompt_len: int, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """Bytes the prefill worker sends for a prompt: K and V, every layer, every KV head, of the prompt's
    full blocks except the one holding its last token (the decode worker computes that token itself)."""
    tokens = (prompt_len - 1) // block_size * block_size
    return 2 * cfg.n_layers * tokens * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def colocated_run(prompts: list[list[int]], params, engine_options: dict | None = None, threads: int = 1,
                  model=None, tokenizer=None) -> dict:
    """The baseline: the same requests, all arriving at once, on one engine in this process that prefills
    (in chunks) and decodes in the same steps; {"requests", "steps"} as disaggregated_run gives them."""
    import minillm
    from minillm.engine import LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    options = {"kv_cache_memory": 64 << 20, **(engine_options or {})}
    engine = LLMEngine(model or minillm.load_model(), tokenizer or minillm.load_tokenizer(),
                       enable_prefix_caching=True, verbose=False, **options)
    try:
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, params, arrival_time=t0)
        outputs, steps = {}, []
        while engine.has_unfinished_requests():
            _timed_step(engine, t0, outputs, steps)
    finally:
        torch.set_num_threads(before)
    return {"requests": [_result(outputs[i]) for i in range(len(prompts))], "steps": steps}
