"""Exact verification: keep as many drafted tokens as the target's own distribution allows.

A proposer guesses k tokens x_1..x_k, drawn from its distributions q_1..q_k. The target scores
the last accepted token plus the k drafts in one pass, which gives k + 1 distributions
p_1..p_{k+1} (after the same sampling filters). Then, left to right:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    at the first rejection: emit a token drawn from normalize(max(0, p_i - q_i)), stop
    all k accepted: emit a bonus token drawn from p_{k+1}

Why the output is distributed exactly as p (per position): the chance to emit token y is
    q(y) min(1, p(y)/q(y))  +  (1 - sum_z min(p(z), q(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z))
  = min(p(y), q(y))       +  max(0, p(y) - q(y))                                              = p(y),
because 1 - sum min(p, q) = sum max(0, p - q) (both sum to 1). The drafts only decide how much
work one target pass saves, never what comes out.

Two limits of the rule:
- Greedy: p is one-hot at the target's argmax. A draft is accepted exactly when it equals the
  argmax (ratio 1/q >= 1), and max(0, p - q) is one-hot at the argmax, so the corrected token is
  what plain greedy decoding would have produced. No random number is drawn.
- A deterministic proposer (n-gram lookup) has q = one-hot at its guess x: accept x with
  probability p(x); on rejection draw from p with x removed, renormalised.
"""
from __future__ import annotations

import torch

from ..sampling import SamplingParams, filtered_probs


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (T, vocab) -> the distributions a token is drawn from (T, vocab): the sampling filters
    applied, or one-hot at the argmax for greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return filtered_probs(logits, params)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs (vocab,). A one-hot distribution needs no random number."""
    top = int(probs.argmax())
    if probs[top] >= 1.0 or generator is None:
        return top
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        raise ValueError("a random draw is needed (the target is not greedy): pass a generator")
    return float(torch.rand((), generator=generator, device=generator.device))


def verify(draft_ids, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens to emit: the accepted drafts, then one corrected or bonus token (1 to k + 1 ids).

    draft_ids     (k,) the proposed tokens (a list or a tensor; k may be 0)
    draft_probs   (k, vocab) the proposer's distributions, or None for a deterministic proposer (q one-hot)
    target_probs  (k + 1, vocab) the target's distributions at the last accepted token and at each draft
    generator     random stream for the accept tests and the draws (not needed when the target is greedy)
    """
    draft_ids = [int(x) for x in draft_ids]
    k = len(draft_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs needs k + 1 = {k + 1} rows for {k} drafts; got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs needs one row per draft ({k}); got {draft_probs.shape[0]}")
    out = []
    for i, x in enumerate(draft_ids):
        p = target_probs[i]                                       # (vocab,)
        p_x = float(p[x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if p_x >= q_x or (p_x > 0 and _uniform(generator) * q_x < p_x):   # accept: probability min(1, p/q)
            out.append(x)
            continue
        if draft_probs is None:                                   # q one-hot: p without x
            residual = p.clone()
            residual[x] = 0
        else:
            residual = (p - draft_probs[i]).clamp_min(0)
        out.append(_draw(residual / residual.sum(), generator))
        return out
    out.append(_draw(target_probs[k], generator))                 # all accepted: the bonus token
    return out


def verify_greedy(draft_ids, target_argmax) -> list[int]:
    """`verify` for a greedy target, without building one-hot rows: the drafts up to the first one that
    differs from the target's argmax, then the argmax there (or the bonus argmax after all k).
    target_argmax: (k + 1,) the target's argmax at the last accepted token and at each draft."""
    best = [int(t) for t in target_argmax]
    out = []
    for x, b in zip(draft_ids, best):
        if int(x) != b:
            break
        out.append(b)
    return out + [best[len(out)]]


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one target pass emits when each draft is accepted with probability alpha, independently:
    1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Speedup over plain decoding: tokens per target pass over the time of one round, in decode steps.
    c: one draft step's time / one decode step's; verify_cost: a (k + 1)-token pass's time / one decode
    step's. With verify_cost = 1 (free extra rows, as on a GPU at small batch):
    (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)). On a CPU extra rows are not free: measure it."""
    return expected_tokens_per_step(alpha, k) / (k * c + verify_cost)
