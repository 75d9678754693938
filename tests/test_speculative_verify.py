"""The rejection rule of speculative decoding: exact in distribution, exact for greedy.

Random p (target) and q (draft) over a small vocabulary, with zeros placed where the other is not:
the first emitted token must follow p, whatever q is, for k = 1 and k > 1, and for the one-hot q
of a deterministic proposer. Chi-square at a fixed seed; the critical values are for p = 0.001.
"""
import pytest
import torch

from minillm.sampling import SamplingParams
from minillm.speculative import expected_tokens_per_step, lookup_ngram, predicted_speedup, target_probs, verify

V = 6
CHI2_CRIT_0001 = {4: 18.467, 5: 20.515}   # chi-square critical value at p = 0.001, by degrees of freedom


def _pq(seed: int):
    g = torch.Generator().manual_seed(seed)
    p, q = torch.rand(V, generator=g), torch.rand(V, generator=g)
    p[0] = 0.0                  # the target never emits token 0, the draft may propose it
    q[1] = 0.0                  # the draft never proposes token 1, the target may emit it
    return p / p.sum(), q / q.sum()


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with p = 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("deterministic", [False, True])
def test_first_token_follows_the_target(k, deterministic):
    p, q = _pq(seed=k)
    g = torch.Generator().manual_seed(1234)
    trials = 6000
    counts = torch.zeros(V)
    for _ in range(trials):
        if deterministic:                                       # n-gram: the same guess every time, q one-hot
            drafts, dq = [0, 2, 3][:k], None
        else:
            drafts = torch.multinomial(q, k, replacement=True, generator=g).tolist()
            dq = q.expand(k, V)
        out = verify(drafts, dq, p.expand(k + 1, V), g)
        assert 1 <= len(out) <= k + 1
        counts[out[0]] += 1
    dof = int((p > 0).sum()) - 1
    assert _chi2(counts, p) < CHI2_CRIT_0001[dof]


@pytest.mark.parametrize("k", [1, 4])
def test_mean_accepted_length_matches_the_formula(k):
    """Same p and q at every position: each draft is accepted with probability alpha = sum min(p, q),
    so a pass emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average."""
    p, q = _pq(seed=7)
    alpha = float(torch.minimum(p, q).sum())
    g = torch.Generator().manual_seed(99)
    trials = 4000
    total = 0
    for _ in range(trials):
        drafts = torch.multinomial(q, k, replacement=True, generator=g).tolist()
        total += len(verify(drafts, q.expand(k, V), p.expand(k + 1, V), g))
    mean = total / trials
    expected = expected_tokens_per_step(alpha, k)
    # the emitted count is at most k + 1: its standard deviation is below (k + 1) / 2
    assert abs(mean - expected) < 4 * (k + 1) / 2 / trials ** 0.5
    assert k == 1 or mean > 1.2


def test_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, SamplingParams())                  # one-hot rows
    best = logits.argmax(-1).tolist()
    assert verify(best[:3], None, p) == best                    # all accepted + the bonus
    assert verify([best[0], (best[1] + 1) % 50, best[2]], None, p) == best[:2]  # corrected at the miss
    assert verify([], None, p[:1]) == best[:1]                  # no drafts: a plain decode step
    assert verify(torch.tensor(best[:3]), None, p) == best      # tensors work too


def test_sampled_rule_needs_a_generator_and_right_shapes():
    p = torch.full((3, 5), 0.2)
    with pytest.raises(ValueError, match="generator"):
        verify([1, 2], None, p)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify([1], None, p)
    with pytest.raises(ValueError, match="one row per draft"):
        verify([1, 2], torch.full((1, 5), 0.2), p, torch.Generator())


def test_target_probs_apply_the_sampling_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[0, 2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))


def test_ngram_lookup():
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert lookup_ngram(seq, 3, 1, 3) == [8, 9, 1]              # "5 6 7" occurred before: what followed it
    assert lookup_ngram(seq, 10, 1, 3) == [8, 9, 1, 2, 5, 6, 7]  # at most what exists
    assert lookup_ngram([1, 2, 3, 4], 2, 1, 3) == []            # no earlier occurrence
    assert lookup_ngram([3, 1, 3, 2, 3], 2, 1, 1) == [2, 3]     # the most recent earlier match wins
    assert lookup_ngram([4, 4, 4], 2, 1, 4) == [4]              # overlaps are fine


def test_predicted_speedup():
    assert predicted_speedup(0.0, 4, 0.0) == 1.0                # nothing accepted, free drafts: no change
    assert predicted_speedup(1.0, 4, 0.0) == 5.0
    assert predicted_speedup(0.5, 1, 0.5) == pytest.approx(1.5 / 1.5)


def test_adaptive_k_drafts_only_where_it_pays():
    from minillm.speculative.adaptive import MAX_WAIT, AdaptiveK

    cpu = {1: 1.0, 2: 1.6, 3: 1.8, 4: 1.2, 5: 1.2}          # as measured on one CPU: 2-3 rows cost more than 4
    ctl = AdaptiveK(4, cpu, prior=0.5)
    assert ctl.choose(room=2) == 2 and ctl.probing            # a new sequence probes first
    ctl.update(2, 1)                                          # alpha stays 0.5
    assert ctl.choose() == 4 and ctl.choose(room=2) == 0      # at alpha 0.5: all four; one or two cost more
    assert ctl.keep(2) == 0 and ctl.keep(3) == 3              # fewer found: verify only if that pays
    for _ in range(6):
        ctl.update(4, 0)                                      # every first draft rejected
    assert ctl.alpha < 0.1 and ctl.choose() == 0 and ctl.wait == 4   # failed drafts, but no probe yet
    gaps = []
    for _ in range(5):                                        # a probe after plain steps; each one fails
        n = 1
        while ctl.choose() == 0:
            n += 1
        assert ctl.probing
        gaps.append(n)
        ctl.update(4, 0)
    assert gaps == [3, 8, 16, MAX_WAIT, MAX_WAIT]             # (one plain step above): the wait doubles
    ctl.update(4, 4)                                          # it copies now: probes come soon again
    assert ctl.wait == 4
    ctl.update(4, 4)
    assert ctl.alpha > 0.5 and ctl.choose() == 4
    costly = AdaptiveK(3, {1: 1.0, 2: 1.5, 3: 1.8, 4: 1.2}, draft_cost=0.8, prior=0.0)
    assert [costly.choose() for _ in range(20)] == [0] * 20   # would not pay even at alpha 0.9: never probed
    with pytest.raises(ValueError, match="missing"):
        AdaptiveK(4, {1: 1.0, 2: 1.1})


def test_in_a_batch_drafts_pay_only_where_extra_tokens_are_cheap():
    """The engine prices a step's drafts with the step times it has measured (per size seen, a fitted line
    between). One sequence whose step is mostly a fixed cost (reading the weights) drafts; 64 sequences in
    a step whose time grows with every token do not: the 63 others would wait for drafts that add less than
    they cost. In a mixed batch only the likely sequences draft."""
    from minillm.speculative.adaptive import StepTimes, choose_batch

    times = StepTimes()
    assert times.step(1) == times.step(9)                     # nothing seen yet: extra tokens are free
    for tokens in (1, 2, 5, 64, 70):
        times.observe(tokens, 0.03 + 0.002 * tokens)
    a, b = times.line()
    assert abs(a - 0.03) < 1e-9 and abs(b - 0.002) < 1e-9
    assert choose_batch([0.6], [4], 1, 1, 4, times, 0.0) == [4]
    assert choose_batch([0.6] * 64, [4] * 64, 64, 64, 4, times, 0.0) == [0] * 64
    assert choose_batch([0.95, 0.1, 0.2], [4, 4, 2], 3, 3, 4, times, 0.0) == [4, 0, 0]
    jagged = StepTimes()                                      # a measured size overrides the line
    jagged.observe(1, 0.03)
    jagged.observe(2, 0.5)
    assert jagged.step(2) == 0.5 and choose_batch([0.9], [1], 1, 1, 1, jagged, 0.0) == [0]
    assert times.draft(3, 0.0) == 0.0 and times.draft(3, 0.25) == 0.25 * times.step(3)
    times.observe_draft(3, 0.01)
    assert times.draft(3, 0.25) == 0.01


def test_adaptive_speculation_needs_a_proposer():
    """One rule for generate, the engine and the command line: asked for adaptive k without a proposer, a
    clear error; with one, adaptive unless told otherwise."""
    from minillm.speculative.adaptive import K_ADAPTIVE, K_FIXED, speculation_settings

    with pytest.raises(ValueError, match="give speculative= too"):
        speculation_settings(None, True, None)
    assert speculation_settings(None, None, None) == speculation_settings(None, False, 3) == (False, None)
    assert speculation_settings("ngram", None, None) == (True, K_ADAPTIVE)
    assert speculation_settings("ngram", False, None) == (False, K_FIXED)
    assert speculation_settings("ngram", None, 3) == (True, 3)
