"""Counting bytes and FLOPs of a forward pass, and measuring what this machine can move and compute.

A decode step for a batch of B sequences with S cached tokens must
    read every weight once                      weight_bytes
    read each sequence's K/V cache              B x kv_cache_bytes(S)
    do ~2 FLOPs per weight per token            2 x params x B   (+ attention: 4 x S x layers x heads x hd x B)
The step can be no faster than bytes / bandwidth (memory floor) nor FLOPs / peak (compute floor).
At B = 1 the memory floor is far higher: decode is memory-bound.

The rates are measured here: the bandwidth as a long read (the largest of a tensor far larger than the
caches: a decode step, too, reads weights and cache and writes almost nothing), the peak as a large
matmul. A copy is the wrong measure for a read-only step: it mixes a read stream and a written one (on
x86 each written line is read first as well), which memory serves at another total rate than a single
read, higher on some machines and lower on others. The floors are still estimates from this machine's
rates, not physical bounds.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..kv import kv_cache_bytes
from ..model import weight_bytes  # noqa: F401  (re-exported for the notebooks)
from .timing import median_time


def forward_bytes(model, batch: int, context: int, kv_dtype: str | None = None) -> int:
    """Bytes a decode step must read: the weights once plus every sequence's K/V cache (stored as kv_dtype)."""
    return weight_bytes(model) + batch * kv_cache_bytes(model.cfg, context, model.dtype, kv_dtype)


def forward_flops(cfg: ModelConfig, n_params: int, tokens: int, context: int) -> int:
    """FLOPs of a forward over `tokens` new tokens that each attend over `context` keys:
    2 per weight per token (a multiply and an add), plus QK^T and PV in attention."""
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return tokens * (2 * n_params + attention)


def step_floors(model, tokens: int, context: int, bandwidth: float, flops: float, batch: int = 1) -> dict:
    """Estimated floors of one forward of `batch` sequences, `tokens` new tokens each, attending over
    `context` keys: {"memory_s": bytes / bandwidth, "compute_s": FLOPs / peak}. The larger one is the
    prediction; which one it is says whether the step is memory- or compute-bound."""
    n_params = model.num_parameters()
    return {"memory_s": forward_bytes(model, batch, context) / bandwidth,
            "compute_s": batch * forward_flops(model.cfg, n_params, tokens, context) / flops}


def predict_naive_step_s(model, length: int, bandwidth: float, flops: float) -> float:
    """Stage 1 at sequence length t: a forward over all t tokens, each attending ~t/2 keys on average."""
    return max(step_floors(model, length, length // 2, bandwidth, flops).values())


def predict_kv_step_s(model, length: int, bandwidth: float, flops: float) -> float:
    """Stage 2 at sequence length t: one new token attending t cached keys; reads the weights and the cache."""
    return max(step_floors(model, 1, length, bandwidth, flops).values())


def measure_read_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second that a long reduction reads: x.amax() over n_bytes of float32, far larger than a
    CPU's caches. It writes one number, so this is the rate at which memory can feed a read-only pass, as a
    decode step is; the floors of a step divide its bytes by this. (amax, not sum: torch's sum adds in a
    cascade for accuracy, which on some CPUs keeps it below the memory's rate.)"""
    x = torch.ones(n_bytes // 4)
    t = median_time(lambda: x.amax(), repeats=repeats)
    return n_bytes / t


def measure_copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy, counting bytes read + written. 256 MiB each way: far larger
    than a CPU's caches, small enough to measure beside a loaded model on a laptop. The measure for work
    that copies (notebook 04's repeated K/V); a read-only step's floor uses measure_read_bandwidth."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), repeats=repeats)
    return 2 * n_bytes / t


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """FLOP/s of a square matrix multiply (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = median_time(lambda: a @ b, repeats=repeats)
    return 2 * n**3 / t


def measure_matvec_bandwidth(model, rows: int = 1, repeats: int = 10, fn=None, weights=None) -> float:
    """Weight bytes per second that the model's own matrix products stream with `rows` rows of input:
    every nn.Linear weight and the (tied) output head, multiplied by a (rows, in) activation, the way a
    decode step of `rows` sequences does. `fn(x, w)` replaces F.linear to compare kernels; `weights`
    (a list of the model's weights) measures over those only."""
    import torch.nn.functional as F

    fn = fn or F.linear
    if weights is None:
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if not any(w is model.tok_emb.weight for w in weights):
            weights.append(model.tok_emb.weight)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}   # (rows, in)
    with torch.inference_mode():
        t = median_time(lambda: [fn(xs[w.shape[1]], w) for w in weights], repeats=repeats, warmup=2)
    return sum(w.numel() * w.element_size() for w in weights) / t


def tensor_parallel_token_seconds(weight_bytes: int, world: int, collectives: int, sent_per_rank: int,
                                  memory_bandwidth: float, link_bandwidth: float, collective_latency_s: float,
                                  step_overhead_s: float = 0.0) -> float:
    """An estimate of a memory-bound decode step split across `world` devices: each pays the step's fixed
    cost (step_overhead_s: launches, the host's work per token; every device launches every layer's kernels,
    so splitting does not shrink it), reads its share of the weights at memory_bandwidth, then pays every
    collective's fixed latency and sends its bytes over the link. (Assumes no overlap of communication with
    compute, so it errs on the slow side.)"""
    return (step_overhead_s + weight_bytes / world / memory_bandwidth
            + (collectives * collective_latency_s + sent_per_rank / link_bandwidth if world > 1 else 0.0))
