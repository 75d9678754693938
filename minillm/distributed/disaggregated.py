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

import queue
import threading
import time

import torch
import torch.distributed as dist

from ..kv.manager import Sequence
from .kv_transfer import TransferFailed, recv_sequence, send_sequence

DECODE_RANK, PREFILL_RANK = 0, 1
NOTICE = 1                                                        # the tag of "prompt i is ready"


def send_prefix(kv, prompt_ids: list[int], dst: int, break_off: bool = False) -> dict:
    """Send the K/V of the prompt's cached full blocks (a sequence that borrows them while they travel)."""
    sending = Sequence("sending")
    blocks = kv.borrow_prefix(sending, prompt_ids)
    try:
        return send_sequence(kv, sending, dst, break_off) | {"blocks": len(blocks)}
    finally:
        kv.free(sending)                                          # parked again, still cached here


def recv_prefix(kv, prompt_ids: list[int], src: int) -> dict:
    """Receive a prompt's full blocks into this prefix-caching pool and register them under their
    addresses, parked like blocks this pool computed. TransferFailed (nothing kept) if they do not arrive."""
    arriving = Sequence("arriving")
    stats = recv_sequence(kv, arriving, src, sender="the prefill worker")
    blocks = len(kv.block_table(arriving))
    kv.register_prefix(arriving, prompt_ids)
    kv.free(arriving)                                             # refcount 0 and registered: parked
    return stats | {"blocks": blocks}


def _prefill_worker(engine, prompts, break_at, t0) -> list[tuple]:
    """Compute each prompt (max_tokens=1), say it is ready, ship its blocks; the timeline of that."""
    from minillm.sampling import SamplingParams

    events = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter() - t0
        engine.add_request(i, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        done = time.perf_counter() - t0
        dist.send(torch.tensor([i]), DECODE_RANK, tag=NOTICE)             # "prompt i is ready": the decode
        send_prefix(engine.kv, prompt, DECODE_RANK, break_off=(i == break_at))   # worker takes it between steps
        events += [("prefill", i, start, done), ("send", i, done, time.perf_counter() - t0)]
    return events


def _receive(engine, prompts, i, params, t0) -> dict:
    """Take prompt i's blocks into the prefix cache and queue the request (arrived at t0, with the others)."""
    start = time.perf_counter()
    try:
        got = recv_prefix(engine.kv, prompts[i], PREFILL_RANK) | {"failed": None}
    except TransferFailed as e:                                   # nothing kept: the request is recomputed
        got = {"blocks": 0, "bytes": 0, "seconds": 0.0, "failed": str(e)}
    got["blocks_cached"] = len(engine.pool.cached)                # this pool's registered blocks so far
    got["span"] = (start - t0, time.perf_counter() - t0)
    engine.add_request(i, prompts[i], params, arrival_time=t0)
    return got


class _Notices:
    """The prefill worker's "prompt i is ready" messages, received by a thread of their own, so that the
    decode loop can look for one between steps without ever waiting (gloo's irecv cannot be polled)."""

    def __init__(self, n: int):
        self.queue = queue.Queue()
        threading.Thread(target=self._listen, args=(n,), daemon=True).start()

    def _listen(self, n: int) -> None:
        for _ in range(n):
            ready = torch.zeros(1, dtype=torch.int64)
            try:
                dist.recv(ready, PREFILL_RANK, tag=NOTICE)
            except RuntimeError as e:
                self.queue.put(e)
                return
            self.queue.put(int(ready))

    def next(self, wait: bool) -> int | None:
        """The next ready prompt's index, or None if none is ready (and wait is False)."""
        try:
            got = self.queue.get(timeout=dist.default_pg_timeout.total_seconds()) if wait else self.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(got, Exception):
            raise RuntimeError(f"the prefill worker stopped sending: {str(got).splitlines()[0]}")
        return got


def _decode_worker(engine, prompts, params, overlap, t0) -> dict:
    """Decode, taking each prompt's blocks as they arrive: between steps (overlap) or all before the first."""
    transfers, outputs, steps = {}, {}, []
    notices = _Notices(len(prompts))
    while len(transfers) < len(prompts) or engine.has_unfinished_requests():
        if len(transfers) < len(prompts):
            i = notices.next(wait=not overlap or not engine.has_unfinished_requests())
            if i is not None:
                transfers[i] = _receive(engine, prompts, i, params, t0)
                continue
        _timed_step(engine, t0, outputs, steps)
    return {"requests": [_result(outputs[i]) | transfers[i] for i in range(len(prompts))], "steps": steps}


def _timed_step(engine, t0, outputs: dict, steps: list) -> None:
    """One engine step: finished requests into outputs, (start, end, tokens, running) onto steps."""
    start = time.perf_counter() - t0
    for o in engine.step():
        if o.finished:
            outputs[o.request_id] = o
    stats = engine.stats()
    steps.append((start, time.perf_counter() - t0, stats["tokens_last_step"], stats["running"]))


def _result(o) -> dict:
    return {"token_ids": o.token_ids, "text": o.text, "num_cached_tokens": o.num_cached_tokens,
            "ttft_s": o.metrics.ttft_s, "itl_s": o.metrics.itl_s, "e2e_s": o.metrics.e2e_s}


def _worker(rank, world, prompts, params, engine_options, break_at, overlap):
    import minillm
    from minillm.engine import LLMEngine

    torch.set_num_threads(1)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    engine = LLMEngine(model, tok, enable_prefix_caching=True, verbose=False, **engine_options)
    dist.barrier()                                                # both loaded: the clock starts together
    t0 = time.perf_counter()
    if rank == PREFILL_RANK:
        events = _prefill_worker(engine, prompts, break_at, t0)
        dist.send(torch.tensor([[kind == "send", i, a, b] for kind, i, a, b in events], dtype=torch.float64), DECODE_RANK)
        return None
    run = _decode_worker(engine, prompts, params, overlap, t0)
    events = torch.zeros(2 * len(prompts), 4, dtype=torch.float64)   # the prefill worker's timeline
    dist.recv(events, PREFILL_RANK)
    run["prefill"] = [("send" if k else "prefill", int(i), a, b) for k, i, a, b in events.tolist()]
    return run


def disaggregated_run(prompts: list[list[int]], params, engine_options: dict | None = None,
                      break_at: int | None = None, overlap: bool = True, timeout_s: float = 300.0) -> dict:
    """Every prompt prefilled by one process (rank 1) and decoded by another (rank 0), all arriving at
    once; {"requests": per prompt, in order, "steps": the decode worker's (start, end, tokens, running),
    "prefill": the prefill worker's ("prefill" | "send", prompt, start, end)}, times from the start.
    Per request: token_ids, text, num_cached_tokens (prompt tokens the decode worker did not compute),
    ttft_s, itl_s, e2e_s, and its transfer: blocks, bytes, seconds, span, failed (None, or why it broke
    off: that prompt was recomputed), blocks_cached (the decode pool's registered blocks after it arrived).
    overlap=False receives every prompt before decoding starts."""
    from .launch import run_ranks

    options = {"kv_cache_memory": 64 << 20, **(engine_options or {})}
    return run_ranks(_worker, 2, [list(p) for p in prompts], params, options, break_at, overlap, timeout_s=timeout_s)


def disaggregated_generate(prompts: list[list[int]], params, engine_options: dict | None = None,
                           break_at: int | None = None, overlap: bool = True, timeout_s: float = 300.0) -> list[dict]:
    """disaggregated_run's per-request results only."""
    return disaggregated_run(prompts, params, engine_options, break_at, overlap, timeout_s)["requests"]
