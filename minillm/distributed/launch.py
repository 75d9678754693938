"""Start the ranks of one job from one command, on this machine: a rendezvous on a loopback port, one
process per rank (gloo on CPUs), and a deadline on everything, so a rank that fails or never joins ends
the whole run with a message instead of a hang.

    run_ranks(fn, world, *args, timeout_s=120)   fn(rank, world, *args) in every rank; rank 0's result
    tensor_parallel_generate(prompt_ids, params, world)   the kv stage on a model split across `world` ranks
    tensor_parallel_engine_generate(prompts, params, world)   the serving engine on such a model
    init_from_env() + tensor_parallel_rank(...)           the same, each rank started by torchrun
"""
from __future__ import annotations

import os
import queue
import socket
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    """Join the job's process group; every collective afterwards gives up after timeout_s."""
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:   # the store's own message names the missing ranks
        raise RuntimeError(f"rank {rank} of {world}: the other ranks did not all join within {timeout_s:g} s "
                           f"({type(e).__name__}: {str(e).splitlines()[0]})") from None


def _rank_main(rank, world, port, timeout_s, fn, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        init_rank(rank, world, port, timeout_s)
        out = fn(rank, world, *args)
        leave()
        results.put(("ok", rank, out if rank == 0 else None))
    except BaseException as e:   # noqa: BLE001 - reported to the parent, which ends every rank
        results.put(("error", rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0, join_timeout_s: float | None = None):
    """Run fn(rank, world, *args) in `world` fresh processes; return rank 0's result. The first rank to fail
    ends them all (RuntimeError naming it); the whole run is bounded by timeout_s (TimeoutError).
    join_timeout_s: how long ranks wait for each other in the rendezvous and in every collective."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, join_timeout_s or timeout_s, fn, args, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline, done, answer = time.monotonic() + timeout_s, 0, None
    try:
        while done < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world - done} of {world} ranks still running after {timeout_s:g} s")
            try:
                status, rank, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {world} died (exit code {procs[dead[0]].exitcode})")
                continue
            if status == "error":
                time.sleep(0.5)                        # a rank that died takes its partners down with it:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r != rank]
                if dead:                               # name the cause, not the first rank to notice
                    raise RuntimeError(f"rank {dead[0]} of {world} died (exit code {procs[dead[0]].exitcode}); "
                                       f"rank {rank} then failed: {value}")
                raise RuntimeError(f"rank {rank} of {world} failed: {value}")
            done += 1
            answer = value if rank == 0 else answer
        return answer
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def leave() -> None:
    """End this rank's part in the job: wait until every rank is done, then close the connections. A rank
    that closed while a partner still had the group open would break that partner's connections under it."""
    dist.barrier()
    dist.destroy_process_group()


def init_from_env(timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); (rank, world)."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _leader_model(rank, world, path):
    """This rank's shard of the model. On rank 0 return it; on the others run what rank 0 announces until
    it says stop, and return None."""
    import torch

    import minillm

    from .leader import follow
    from .tensor_parallel import shard_model

    torch.set_num_threads(1)
    model = shard_model(minillm.load_model(path), rank, world)
    if rank == 0:
        return model
    follow(model)
    return None


def tensor_parallel_rank(rank, world, prompt_ids, params, path=None, with_logits=False):
    """One rank of a tensor-parallel generation. Rank 0 tokens in, result out: {"token_ids", "text",
    "decode_tokens_per_s"} and, with_logits, "prompt_logits" (one more pass over the prompt); the others
    only follow (None). Started by run_ranks (one command) or by torchrun (init_from_env first)."""
    import minillm
    from minillm.generate import generate

    from .leader import STOP, LeaderRunner, announce

    model = _leader_model(rank, world, path)
    if model is None:
        return None
    tok = minillm.load_tokenizer(path)
    max_len = min(len(prompt_ids) + params.max_tokens, model.cfg.max_seq_len)
    out = generate(model, tok, prompt_ids, params, stage="kv", runner=LeaderRunner(model, max_len))
    result = {"token_ids": out.token_ids, "text": out.text, "decode_tokens_per_s": out.decode_tokens_per_s}
    if with_logits:                                                 # (vocab,) the last prompt token's, by value
        result["prompt_logits"] = LeaderRunner(model, max_len).prefill(prompt_ids).numpy()
    announce(STOP)
    return result


def tensor_parallel_generate(prompt_ids: list[int], params, world: int, path=None, with_logits: bool = False,
                             timeout_s: float = 300.0) -> dict:
    """Greedy or sampled generation (the kv stage) with the model split across `world` ranks of this
    machine; rank 0's {"token_ids", "text", "decode_tokens_per_s"} (+ "prompt_logits", with_logits).
    Rank 0 tokenizes, samples and decodes text; the other ranks run only their share of each forward pass."""
    import minillm

    from .tensor_parallel import check_tensor_parallel

    check_tensor_parallel(minillm.ModelConfig(), world)
    return run_ranks(tensor_parallel_rank, world, list(prompt_ids), params, path, with_logits, timeout_s=timeout_s)


def tensor_parallel_engine_rank(rank, world, prompts, params, engine_options, path=None, n=1):
    """One rank of a tensor-parallel serving engine. Rank 0 schedules, samples and detokenizes: a list of
    {"token_ids", "text", "finish_reason"} per prompt (n per prompt), in order; the others only follow."""
    import minillm

    from .leader import STOP, announce, leader_engine

    model = _leader_model(rank, world, path)
    if model is None:
        return None
    engine = leader_engine(model, minillm.load_tokenizer(path), verbose=False, **engine_options)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, n=n)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    announce(STOP)
    return [{"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason}
            for _, o in sorted(done.items(), key=lambda kv: [int(x) for x in kv[0].split("/")])]


def tensor_parallel_engine_generate(prompts: list[list[int]], params, world: int, engine_options: dict | None = None,
                                    path=None, n: int = 1, timeout_s: float = 300.0) -> list[dict]:
    """The serving engine (continuous batching, chunked prefill, paged KV cache) on a model split across
    `world` ranks of this machine: rank 0 runs the scheduler; each step is one forward pass on every rank.
    n > 1: n samples per prompt, sharing the prompt's blocks (copy-on-write on every rank)."""
    import minillm

    from .tensor_parallel import check_tensor_parallel

    check_tensor_parallel(minillm.ModelConfig(), world)
    options = {"kv_cache_memory": 64 << 20, **(engine_options or {})}
    return run_ranks(tensor_parallel_engine_rank, world, [list(p) for p in prompts], params, options, path, n,
                     timeout_s=timeout_s)
