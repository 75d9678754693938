"""What tensor parallelism costs, for notebook 13 and benchmarks/distributed.py: the bytes a split token
sends against the weights each rank reads (`communication_bytes`), and one all-reduce timed on the ranks
(`all_reduce_seconds`). The split itself is `minillm/distributed/tensor_parallel.py`."""
from __future__ import annotations

import torch
import torch.distributed as dist


def communication_bytes(cfg, world: int, dtype_bytes: int = 4) -> dict:
    """What one decoded token costs in communication, against the weights each rank reads:
    collectives (2 all-reduces per block, 1 for the embedding, 1 all-gather of the logits), payload (bytes
    of the results they combine) and sent_per_rank (a ring all-reduce sends 2 (w-1)/w of its payload from
    each rank, an all-gather (w-1)/w), and weight_bytes_per_rank (every parameter once, / world)."""
    d, L, vocab = cfg.d_model, cfg.n_layers, cfg.vocab_size
    reduce_payload = (2 * L + 1) * d * dtype_bytes                      # (1, d) activations each
    gather_payload = vocab * dtype_bytes                                # one row of logits
    params = (1 if cfg.tie_embeddings else 2) * vocab * d + L * (d * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
                              + cfg.n_heads * cfg.head_dim * d + 3 * d * cfg.ffn_dim + 2 * d) + d
    return {"collectives": 2 * L + 2, "payload": reduce_payload + gather_payload,
            "sent_per_rank": round((2 * reduce_payload + gather_payload) * (world - 1) / world),
            "weight_bytes_per_rank": params * dtype_bytes // world}


def all_reduce_seconds(rank: int, world: int, numel: int, repeats: int = 200) -> float | None:
    """Run in every rank (run_ranks): the median time of one all-reduce of `numel` float32 values."""
    import statistics
    import time

    x, times = torch.ones(numel), []
    for _ in range(3):                         # untimed: the first collectives open the ranks' connections
        dist.barrier()
        dist.all_reduce(x)
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if rank == 0 else None
