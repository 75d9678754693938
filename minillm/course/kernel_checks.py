"""The Triton kernels against a float64 reference on fresh random inputs, as one call a notebook can show
(the test suite checks many more cases: tests/test_triton_flash.py, tests/test_triton_paged.py)."""
from __future__ import annotations

import torch

from ..attention.naive import naive_attention
from ..device import pick_device


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _reference(q, k, v):
    """q (T, H, D), k, v (S, H_kv, D) -> (T, H, D) in float64, causal bottom-right."""
    t = lambda x: x.double().transpose(0, 1)[None]                       # (1, heads, len, D)
    return naive_attention(t(q), t(k), t(v))[0].transpose(0, 1)


def flash_kernel_checks(seed: int = 2, device=None) -> dict:
    """The prefill kernel on three packed sequences (ragged, one with a cached prefix of 30 keys), and the
    decode kernel split over 4 key slices on three cache lengths, both with 9 query and 3 KV heads of 64.
    device: where the kernels run (default: the GPU when there is one; the inputs are drawn on the CPU from
    `seed` and moved there, so every device sees the same numbers).
    Returns the worst absolute error of each against float64."""
    from ..attention.triton_flash import INTERPRETED

    device = pick_device(device)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)        # noqa: E731
    lens_q, lens_k = [1, 37, 100], [1, 37, 130]
    lens = [200, 64, 1]
    return {"prefill_max_error": _prefill_error(rand, lens_q, lens_k, device),
            "decode_max_error": _decode_error(rand, lens, device), "interpreted": INTERPRETED,
            "device": str(device), "prefill_lengths": {"queries": lens_q, "keys": lens_k}, "decode_lengths": lens}


def _prefill_error(rand, lens_q: list[int], lens_k: list[int], device) -> float:
    from ..attention.triton_flash import flash_attn_varlen

    q = rand(sum(lens_q), 9, 64)
    k, v = (rand(sum(lens_k), 3, 64) for _ in range(2))
    out = flash_attn_varlen(q, k, v, _cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k),
                            causal=True)
    worst, iq, ik = 0.0, 0, 0
    for tq, tk in zip(lens_q, lens_k):
        ref = _reference(q[iq:iq + tq], k[ik:ik + tk], v[ik:ik + tk])
        worst = max(worst, (out[iq:iq + tq].double() - ref).abs().max().item())
        iq, ik = iq + tq, ik + tk
    return worst


def _decode_error(rand, lens: list[int], device) -> float:
    from ..attention.triton_flash import decode_attention

    kc, vc = (rand(3, 200, 3, 64) for _ in range(2))                          # (B, max_len, H_kv, D)
    qd = rand(3, 9, 64)                                                       # (B, H, D)
    outd = decode_attention(qd, kc, vc, torch.tensor(lens, dtype=torch.int32, device=device), num_splits=4)
    return max((outd[b].double() - _reference(qd[b:b + 1], kc[b, :n], vc[b, :n])[0]).abs().max().item()
               for b, n in enumerate(lens))
