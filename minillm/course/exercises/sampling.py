"""Notebook 02: top-p and min-p filters, checked against minillm.sampling."""
from __future__ import annotations

import torch

from ...sampling import min_p_filter, top_p_filter
from .check import Case, run_checks


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale   # (rows, vocab)


def _compare(got, logits: torch.Tensor, want: torch.Tensor, knob: str) -> str | None:
    """None if `got` keeps exactly the tokens `want` keeps, with their logits unchanged."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"expected a tensor of shape {tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}"
    for r in range(want.shape[0]):
        kept, want_kept = got[r].isfinite(), want[r].isfinite()
        if not torch.equal(kept, want_kept):
            extra = (kept & ~want_kept).sum().item()
            missing = (want_kept & ~kept).sum().item()
            hint = ""
            if knob.startswith("p ") and missing == 1 and not extra:
                hint = "; keep the token whose probability crosses p, too"
            if knob == "p = 1.0" and missing:
                hint = "; p = 1 must keep every token (float sums can reach 1 early: treat p >= 1 as no filter)"
            return (f"{knob}, row {r}: kept {int(kept.sum())} tokens, expected {int(want_kept.sum())} "
                    f"({extra} too many, {missing} missing){hint}")
        if not torch.equal(got[r][kept], logits[r][kept]):
            return f"{knob}, row {r}: the kept logits changed; a filter only sets the dropped ones to -inf"
        if not torch.isneginf(got[r][~kept]).all():
            return f"{knob}, row {r}: dropped tokens must be -inf, so softmax gives them probability 0"
    return None


def _filter_cases(reference, knob: str, values, ties: torch.Tensor) -> list[Case]:
    cases = []
    for i, v in enumerate(values):
        logits = _logits(3, 1000, seed=i)

        def run(fn, logits=logits, v=v):
            before = logits.clone()
            got = fn(logits, v)
            if not torch.equal(logits, before):
                return "the input logits were changed in place; return a new tensor"
            return _compare(got, logits, reference(logits, v), f"{knob} = {v}")
        cases.append(Case(f"{knob} = {v} on 3 rows of 1,000 random logits", run))
    v_tie = values[len(values) // 2]
    cases.append(Case(f"{knob} = {v_tie} with tied logits",
                      lambda fn: _compare(fn(ties.clone(), v_tie), ties, reference(ties, v_tie), f"{knob} = {v_tie}")))
    return cases


def check_top_p(fn) -> bool:
    """fn(logits (B, V), p) -> logits with everything outside the nucleus set to -inf."""
    ties = torch.tensor([[2.0, 2.0, 1.0, 1.0, 0.0, -1.0]])
    # edge cases: p = 1 keeps everything; a tiny p keeps only the best token
    return run_checks(fn, _filter_cases(top_p_filter, "p", [1e-4, 0.5, 0.9, 1.0], ties), "your top-p filter")


def check_min_p(fn) -> bool:
    """fn(logits (B, V), min_p) -> logits with tokens below min_p x the best probability set to -inf."""
    ties = torch.tensor([[3.0, 3.0, 1.0, 0.5, 0.0, -1.0]])
    return run_checks(fn, _filter_cases(min_p_filter, "min_p", [0.0, 0.05, 0.1, 0.5], ties), "your min-p filter")


def sampled_phrase_share(model, prompt_ids: list[int], phrase_ids: list[int], params, n: int = 4000,
                         seed: int = 0) -> float:
    """The share of n seeded continuations of prompt_ids that begin with phrase_ids (notebook 02's exercise 3
    measures with it, after the learner's prediction). Each step is drawn n times, seeded, from the
    distribution the engine's sampler draws from after the phrase's earlier tokens (`filtered_probs`, then
    `torch.multinomial`, as `sample_next_token` does); a continuation counts while every step drew the phrase."""
    from ...generate import NaiveRunner
    from ...sampling import filtered_probs, make_generator

    g, hits = make_generator(seed), torch.ones(n, dtype=torch.bool)
    for k, want in enumerate(phrase_ids):
        probs = filtered_probs(NaiveRunner(model).prefill(prompt_ids + phrase_ids[:k]), params)   # (vocab,)
        hits &= torch.multinomial(probs, n, replacement=True, generator=g) == want                 # (n,) draws
    return hits.float().mean().item()
