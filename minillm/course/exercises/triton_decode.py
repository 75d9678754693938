"""Notebook 05: a Triton kernel of the learner's own, one decode query against its head's cached keys with an
online softmax, checked against softmax on fresh inputs and then run as the model's attention at every
decode step (Triton's interpreter on a CPU; compiled on a GPU).

The kernel's arguments, for program `pid` (one query row of one query head; the launcher lays out the query
heads one after another, and the KV heads likewise, each contiguous; GROUP query heads share a KV head, as
in grouped-query attention, and read it where it lies, without a copy per query head):

    Q + pid * D                  the query, (D,)
    K + (pid // GROUP) * S * D   its KV head's keys, (S, D) row-major;  V likewise
    O + pid * D                  where its output goes, (D,)
    S, scale                     the number of keys, 1 / sqrt(D)
    GROUP, D, BLOCK_N            (constexpr) query heads per KV head, head dim, keys per tile
"""
from __future__ import annotations

import math

import torch

from ...attention import sdpa_attention
from ...stages import KVCacheRunner
from .check import Case, run_checks
from .in_model import _greedy_match


def launch(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 16) -> torch.Tensor:
    """q (R, D), k, v (R // GROUP, S, D) -> (R, D): the kernel on a grid of R programs, one per query row;
    query rows g * GROUP ... (g + 1) * GROUP - 1 share KV head g."""
    R, (n_kv, S, D) = q.shape[0], k.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    try:
        kernel[(R,)](q, k, v, out, S, 1.0 / math.sqrt(D), GROUP=R // n_kv, D=D, BLOCK_N=block_n)
    except Exception as e:              # the interpreter (or the compiler) wraps the stub's NotImplementedError
        if "NotImplementedError" in repr(e):
            raise NotImplementedError from e
        raise
    return out


def check_decode_kernel(kernel) -> bool:
    """kernel: a @triton.jit function with the arguments above; its output must be softmax(q kᵀ / √D) v."""
    cases = []
    for R, group, S, D, scale in [(1, 1, 1, 16, 1.0), (3, 1, 16, 64, 1.0), (2, 1, 37, 64, 1.0), (4, 1, 53, 64, 30.0),
                                  (9, 3, 40, 64, 1.0)]:
        def run(kernel, R=R, group=group, S=S, D=D, scale=scale):
            g = torch.Generator().manual_seed(S)
            q = torch.randn(R, D, generator=g) * scale                 # large scores: the max must be kept
            k, v = torch.randn(R // group, S, D, generator=g), torch.randn(R // group, S, D, generator=g)
            kk, vv = (x.double().repeat_interleave(group, dim=0) for x in (k, v))          # the reference only
            want = torch.softmax((kk @ q.double()[:, :, None])[..., 0] / math.sqrt(D), -1)  # (R, S)
            want = (want[:, :, None] * vv).sum(1)                                          # (R, D)
            got = launch(kernel, q, k, v)
            if torch.isnan(got).any():
                return "NaN in the output: do the lanes past the last key get a score of -inf (a mask)?"
            err = (got.double() - want).abs().max().item()
            if err < 1e-4:
                return None
            hint = (" (query row pid reads KV head pid // GROUP: its keys start at K + (pid // GROUP) * S * D)"
                    if group > 1 else
                    " (the keys stop at S: mask the tile's loads and give the lanes past S a score of -inf)" if S < 16
                    else " (one whole tile: scores q·k times scale, then the softmax's weights on v)" if S == 16
                    else " (over several tiles: when the max grows, rescale the running sum and output by "
                         "exp(old max - new max); and mask the last tile)")
            return f"differs from softmax(q kᵀ / √D) v by up to {err:.3g}{hint}"
        cases.append(Case(f"{R} quer{'ies' if R > 1 else 'y'}" + (f" in groups of {group}" if group > 1 else "")
                          + f", {S} keys, head dim {D}" + (", large scores" if scale > 1 else ""), run))
    return run_checks(kernel, cases, "your decode kernel")


def check_decode_kernel_in_model(kernel, model, prompt_ids: list[int], reference: list[int], tok) -> bool:
    """The kernel as the attention of every decode step of stage 2 (SDPA for the prompt): each head's query
    against its group's cached keys, read where the cache holds them. The greedy tokens from prompt_ids must be `reference`."""
    def attn(q, k, v, mask=None):                   # q (B, H, T, hd); k, v (B, n_kv, S, hd)
        B, H, T, hd = q.shape
        if T > 1 or mask is not None:
            return sdpa_attention(q, k, v, mask)    # the prompt: not this kernel's job
        kk, vv = (x.reshape(B * x.shape[1], -1, hd) for x in (k, v))       # (B * n_kv, S, hd): no copy per head
        return launch(kernel, q.reshape(B * H, hd), kk, vv, block_n=64).view(B, H, 1, hd)   # (few tiles: the interpreter is slow)
    runner = KVCacheRunner(model, max_len=len(prompt_ids) + len(reference) + 1, attn_fn=attn)

    def step(ids):                                  # the prompt, then one token a call
        return runner.decode(ids[0]) if runner.cache is not None else runner.prefill(ids)
    return _greedy_match(step, prompt_ids, reference, tok, "your decode kernel")
