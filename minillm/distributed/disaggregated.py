"""Disaggregated prefill and decode: one worker computes prompts, another decodes, and a prompt's KV
cache moves between them over torch.distributed point-to-point.

The hand-over goes through the decode worker's prefix cache (`kv/prefix_cache.py`), the way vLLM's KV
connectors do: the prefill worker sends the K/V of the prompt's full blocks; the decode worker writes them
into free blocks of its own pool and registers each under its content address, exactly as if it had
computed them. The request is then added there as usual: admission finds the prompt cached and computes
only what is left — the last partial block, at most block_size - 1 tokens, plus the last token, whose
logits pick the first answer token. Everything after that is ordinary decoding, so the outputs are the
single engine's.

A transfer that breaks off leaves nothing registered: the decode worker computes the whole prompt itself
(a recompute, same output). Here the sender can break off on purpose (`break_at`), to show and test it.

    rank 0   the decode worker: owns the outputs (run_ranks returns them)
    rank 1   the prefill worker: one prompt at a time, max_tokens=1, then ships its blocks
"""
from __future__ import annotations

import torch

from ..kv.prefix_cache import chain_hashes
from .kv_transfer import TransferFailed, recv_sequence, send_sequence

DECODE, PREFILL = 0, 1


def _full_blocks(pool, prompt_ids: list[int]) -> list[bytes]:
    """Addresses of the prompt's blocks that a request can take from a cache (all but the last token's)."""
    bs = pool.block_size
    return chain_hashes(prompt_ids[:(len(prompt_ids) - 1) // bs * bs], bs)


def send_prefix(pool, prompt_ids: list[int], dst: int, break_off: bool = False) -> dict:
    """Send the K/V of the prompt's cached full blocks (a sequence that borrows them while they travel)."""
    blocks = pool.lookup(_full_blocks(pool, prompt_ids), prompt_ids)
    pool.allocate("sending", 0)
    pool.share("sending", blocks)
    try:
        return send_sequence(pool, "sending", dst, break_off) | {"blocks": len(blocks)}
    finally:
        pool.free_seq("sending")                                  # parked again, still cached here


def recv_prefix(pool, prompt_ids: list[int], src: int) -> dict:
    """Receive a prompt's full blocks into this prefix-caching pool and register them under their
    addresses, parked like blocks this pool computed. TransferFailed (nothing kept) if they do not arrive."""
    stats = recv_sequence(pool, "arriving", src, sender="the prefill worker")
    bs, table = pool.block_size, pool.tables["arriving"]
    for j, address in enumerate(_full_blocks(pool, prompt_ids)):
        pool.register(table[j], address, prompt_ids[j * bs:(j + 1) * bs])
    pool.free_seq("arriving")                                     # refcount 0 and registered: parked
    return stats | {"blocks": len(table)}


def _worker(rank, world, prompts, params, engine_options, break_at):
    import minillm
    from minillm.engine import LLMEngine
    from minillm.sampling import SamplingParams

    torch.set_num_threads(1)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    engine = LLMEngine(model, tok, enable_prefix_caching=True, verbose=False, **engine_options)
    if rank == PREFILL:
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            send_prefix(engine.pool, prompt, DECODE, break_off=(i == break_at))
        return None
    transfers = []
    for i, prompt in enumerate(prompts):
        try:
            transfers.append(recv_prefix(engine.pool, prompt, PREFILL) | {"failed": None})
        except TransferFailed as e:
            transfers.append({"blocks": 0, "bytes": 0, "seconds": 0.0, "failed": str(e)})
        transfers[-1]["blocks_cached"] = len(engine.pool.cached)   # this pool's registered blocks so far
        engine.add_request(i, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
    return [{"token_ids": outputs[i].token_ids, "text": outputs[i].text,
             "num_cached_tokens": outputs[i].num_cached_tokens, **transfers[i]} for i in range(len(prompts))]


def disaggregated_generate(prompts: list[list[int]], params, engine_options: dict | None = None,
                           break_at: int | None = None, timeout_s: float = 300.0) -> list[dict]:
    """Every prompt prefilled by one process and decoded by another; per prompt, in order: token_ids, text,
    num_cached_tokens (prompt tokens the decode worker did not compute), blocks, bytes and seconds of the
    transfer, and failed (None, or why it broke off: that prompt was recomputed)."""
    from .launch import run_ranks

    options = {"kv_cache_memory": 64 << 20, **(engine_options or {})}
    return run_ranks(_worker, 2, [list(p) for p in prompts], params, options, break_at, timeout_s=timeout_s)
