"""The model against an independent implementation of the same file (transformers reading the GGUF)."""
import pytest
import torch

from minillm.attention import causal_mask, naive_attention
from minillm.generate import generate
from minillm.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village, 1 2 3 4 5",
]


def test_causal_mask_is_bottom_right_aligned():
    assert causal_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_mask(1, 4).tolist() == [[True, True, True, True]]  # a decode step sees everything
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_naive_attention_matches_torch_sdpa():
    torch.manual_seed(0)
    q = torch.randn(2, 6, 7, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 7, 16, dtype=torch.float64), torch.randn(2, 2, 7, 16, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(naive_attention(q, k, v), expected)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model, tokenizer, hf_model, prompt):
    ids = torch.tensor([tokenizer.encode(prompt)])
    ours, ref = model(ids), hf_model(ids).logits
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"max relative difference {rel:.2e}"


def test_batched_logits_match_transformers(model, tokenizer, hf_model):
    ids = torch.tensor([tokenizer.encode(PROMPTS[0]), tokenizer.encode("Paris is a city in")[:5]])
    torch.testing.assert_close(model(ids), hf_model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers_for_32_steps(model, tokenizer, hf_model, prompt):
    ids = tokenizer.encode(prompt)
    ours = generate(model, tokenizer, ids, SamplingParams(max_tokens=32)).token_ids
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    assert ours == ref[:len(ours)]
    if len(ours) < 32:  # we stopped on an end token: transformers must have produced it too
        assert ref[len(ours)] in tokenizer.stop_ids


def test_capital_of_france_is_paris(model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = generate(model, tokenizer, ids, SamplingParams(max_tokens=24))
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"
