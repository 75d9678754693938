"""The Triton kernels against a float64 reference on fresh random inputs, as one call a notebook can show
(the test suite checks many more cases: tests/test_triton_flash.py, tests/test_triton_paged.py)."""
from __future__ import annotations

import torch

from ..attention.naive import naive_attention


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _reference(q, k, v):
    """q (T, H, D), k, v (S, H_kv, D) -> (T, H, D) in float64, causal bottom-right."""
    t = lambda x: x.double().transpose(0, 1)[None]                       # (1, heads, len, D)
    return naive_attention(t(q), t(k), t(v))[0].transpose(0, 1)


def flash_kernel_checks(seed: int = 2) -> dict:
    """The prefill kernel on three packed sequences (ragged, one with a cached prefix of 30 keys), and the
    decode kernel split over 4 key slices on three cache lengths, both with 9 query and 3 KV heads of 64.
    Returns the worst absolute error of each against float64."""
    from ..attention.triton_flash import INTERPRETED, decode_attention, flash_attn_varlen

    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [1, 37, 100], [1, 37, 130]
    q = torch.randn(sum(lens_q), 9, 64, generator=g)
    k, v = (torch.randn(sum(lens_k), 3, 64, generator=g) for _ in range(2))
    out = flash_attn_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=True)
    worst_prefill, iq, ik = 0.0, 0, 0
    for tq, tk in zip(lens_q, lens_k):
        ref = _reference(q[iq:iq + tq], k[ik:ik + tk], v[ik:ik + tk])
        worst_prefill = max(worst_prefill, (out[iq:iq + tq].double() - ref).abs().max().item())
        iq, ik = iq + tq, ik + tk

    kc, vc = (torch.randn(3, 200, 3, 64, generator=g) for _ in range(2))     # (B, max_len, H_kv, D)
    qd = torch.randn(3, 9, 64, generator=g)                                  # (B, H, D)
    lens = [200, 64, 1]
    outd = decode_attention(qd, kc, vc, torch.tensor(lens, dtype=torch.int32), num_splits=4)
    worst_decode = max((outd[b].double() - _reference(qd[b:b + 1], kc[b, :n], vc[b, :n])[0]).abs().max().item()
                       for b, n in enumerate(lens))
    return {"prefill_max_error": worst_prefill, "decode_max_error": worst_decode, "interpreted": INTERPRETED,
            "prefill_lengths": {"queries": lens_q, "keys": lens_k}, "decode_lengths": lens}
