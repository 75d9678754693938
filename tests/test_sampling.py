"""Sampling filters as pure functions, and the draws they produce."""
import math

import pytest
import torch

from minillm.sampling import (SamplingParams, add_logit_bias, filtered_probs, make_generator, min_p_filter, penalize,
                              presence_frequency_penalty, repetition_penalty, sample_next_token, token_counts,
                              top_k_filter, top_p_filter)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_p": 2.0}, "min_p"), ({"stop": [""]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_invalid_params_name_the_parameter_and_range(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next_token(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_low_temperature_approaches_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    ids = sample_next_token(logits, SamplingParams(temperature=1e-4), make_generator(0))
    assert torch.equal(ids, logits.argmax(-1))


def test_top_k_keeps_exactly_k_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    kept = top_k_filter(logits, 2).isfinite()
    assert kept.sum() == 2
    assert kept[0].tolist() == [False, True, True, False, False, False]  # ties: lower id first
    assert top_k_filter(logits, 0).isfinite().all()  # 0 = off


def test_top_p_keeps_smallest_set_reaching_p_including_the_crossing_token():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    assert top_p_filter(logits, 0.5).isfinite()[0].tolist() == [True, False, False, False, False]
    assert top_p_filter(logits, 0.6).isfinite()[0].tolist() == [True, True, False, False, False]
    assert top_p_filter(logits, 0.85).isfinite()[0].tolist() == [True, True, True, False, False]
    assert top_p_filter(logits, 0.86).isfinite()[0].tolist() == [True, True, True, True, False]
    assert top_p_filter(logits, 1e-9).isfinite().sum() == 1  # the best token always stays


def test_top_p_works_in_unsorted_order():
    probs = torch.tensor([[0.1, 0.5, 0.05, 0.2, 0.15]])
    assert top_p_filter(probs.log(), 0.6).isfinite()[0].tolist() == [False, True, False, True, False]


def test_min_p_keeps_tokens_near_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert min_p_filter(probs.log(), 0.3).isfinite()[0].tolist() == [True, True, True, False]


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=42)
    draws = lambda: [int(sample_next_token(logits, p, g)) for g in [make_generator(42)] for _ in range(20)]  # noqa
    assert draws() == draws()


def _chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
])
def test_samples_follow_the_filtered_distribution(params):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(5)) * 2
    probs = filtered_probs(logits, params)[0]
    n = 20_000
    gen = make_generator(123)
    draws = sample_next_token(logits.expand(n, -1), params, gen)
    counts = torch.bincount(draws, minlength=12).double()
    assert counts[probs == 0].sum() == 0, "drew a token the filters removed"
    keep = probs > 0
    assert keep.sum() >= 3, "the filters should leave several tokens for this test to mean something"
    p_value = _chi_square_p_value(counts[keep], probs[keep].double() * n)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-5)


# ---------------------------------------------------------------- penalties and bias, by hand
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])


def test_presence_and_frequency_penalties_by_hand():
    counts = token_counts([3, 3, 1, 3], vocab=5)                       # token 3 three times, token 1 once
    assert counts.tolist() == [0, 1, 0, 3, 0]
    out = presence_frequency_penalty(LOGITS, counts, presence=0.5, frequency=0.25)
    # token 1: -1 - 0.5 - 0.25 * 1;  token 3: 3 - 0.5 - 0.25 * 3;  the others unchanged
    assert out.tolist() == [2.0, -1.75, 0.5, 1.75, -2.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    seen = torch.tensor([True, True, False, False, True])
    assert repetition_penalty(LOGITS, seen, 2.0).tolist() == [1.0, -2.0, 0.5, 3.0, -4.0]
    assert torch.equal(repetition_penalty(LOGITS, seen, 1.0), LOGITS)


def test_logit_bias_adds_per_token():
    assert add_logit_bias(LOGITS, ((0, -100.0), (4, 10.0))).tolist() == [-98.0, -1.0, 0.5, 3.0, 8.0]


def test_penalize_uses_prompt_for_repetition_and_output_for_presence():
    params = SamplingParams(presence_penalty=1.0, repetition_penalty=2.0, logit_bias={2: 1.5})
    out = penalize(LOGITS, params, prompt_ids=[0], output_ids=[3])
    # token 0 (prompt): 2 / 2;  token 3 (output): 3 / 2 - 1;  token 2: 0.5 + 1.5
    assert out.tolist() == [1.0, -1.0, 2.0, 0.5, -2.0]
    assert penalize(LOGITS, SamplingParams(), [0], [3]) is LOGITS        # nothing asked: the same tensor


def test_greedy_follows_the_penalized_logits():
    params = SamplingParams(logit_bias={"3": -100})                   # keys may be strings, as in JSON
    assert params.logit_bias == ((3, -100.0),) and params.penalized
    out = penalize(LOGITS, params, [], [])
    assert int(sample_next_token(out[None], params)[0]) == 0          # the best but banned 3 -> the next best


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=2e-180),              # p below float32's smallest: the best token
    SamplingParams(temperature=1e-300),                         # T that overflows logits / T
    SamplingParams(temperature=1.0, repetition_penalty=1e-108),  # a penalty that overflows a seen logit
])
def test_extreme_but_allowed_values_still_give_a_distribution(params):
    """Values inside every range the API allows (found by fuzzing the server): the draw is still from a
    distribution (no inf or NaN), and a tiny T or p keeps only the best token."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5]])
    logits = penalize(logits[0], params, [1], [0]).unsqueeze(0)
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(), torch.tensor(1.0))
    if params.repetition_penalty == 1:
        assert probs[0].argmax() == 1 and probs[0, 1] == 1


def test_a_bad_parameter_names_its_field():
    """Refusals carry the field as data (the server answers with it), not only in the message's words."""
    import pytest

    from minillm.sampling import ParamError, SamplingParams, check_vocab

    for kwargs, field in [({"top_p": 2.0}, "top_p"), ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"), ({"max_tokens": -1}, "max_tokens")]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == field and isinstance(e.value, ValueError)
    with pytest.raises(ParamError) as e:
        check_vocab(SamplingParams(logit_bias={99: 1.0}), vocab=10)
    assert e.value.param == "logit_bias"
