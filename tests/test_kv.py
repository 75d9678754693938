"""Stage 2: the KV cache computes the same function as the naive stage, and GQA attention without copies."""
import pytest
import torch

from minillm.attention import gqa_attention, mask_from_positions, naive_attention, sdpa_attention
from minillm.config import ModelConfig
from minillm.generate import generate, generate_batch
from minillm.kv import KVCache, kv_cache_bytes
from minillm.stages import KVCacheRunner, NaiveRunner
from minillm.sampling import SamplingParams

LONG_PROMPTS = [
    [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
    [{"role": "user", "content": "Explain how a CPU cache works, in detail, with examples."}],
    "import numpy as np\n\ndef train(model, data):\n",
]


def test_kv_cache_bytes_textbook_example():
    cfg = ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336)
    assert kv_cache_bytes(cfg, 1, torch.float16) == 131_072  # 128 KiB per token
    assert kv_cache_bytes(cfg, 8192, torch.bfloat16) == 2**30  # 1 GiB at 8K tokens


def test_cache_allocates_what_the_formula_says(model):
    cache = KVCache(model.cfg, batch=3, max_len=100)
    assert cache.nbytes == 3 * kv_cache_bytes(model.cfg, 100, torch.float32) == 3 * 100 * 46_080


def test_cache_overflow_is_a_clear_error(model):
    cache = KVCache(model.cfg, batch=1, max_len=4)
    cache.begin(4)
    cache.commit()
    with pytest.raises(ValueError, match="KV cache full"):
        cache.begin(1)


@pytest.mark.parametrize("attn", [gqa_attention, sdpa_attention])
@pytest.mark.parametrize("T, S", [(1, 1), (1, 9), (5, 5), (3, 11)])
def test_attention_variants_match_naive(attn, T, S):
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(2, 9, T, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, S, 16, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(attn(q, k, v), naive_attention(q, k, v))
    positions = torch.tensor([[S - T + i for i in range(T)], [max(0, S - T - 2) + i for i in range(T)]])
    mask = mask_from_positions(positions, S)  # the second sequence is shorter: padding hidden
    torch.testing.assert_close(attn(q, k, v, mask), naive_attention(q, k, v, mask))


def test_gqa_attention_does_not_repeat_kv(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: pytest.fail("K/V were repeated"))
    q, k, v = torch.randn(1, 9, 4, 8), torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)
    gqa_attention(q, k, v)


def test_cached_decode_step_logits_equal_full_recompute(model, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy")
    naive, kv = NaiveRunner(model), KVCacheRunner(model, max_len=64)
    a, b = naive.prefill(ids), kv.prefill(ids)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for token in tokenizer.encode(" dog and runs away"):
        a, b = naive.decode(token), kv.decode(token)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt, steps", list(zip(LONG_PROMPTS, (128, 48, 48))))
def test_greedy_tokens_equal_naive_over_long_runs(model, backend_model, tokenizer, prompt, steps):
    """One run long enough for rounding to build up (128 steps), two of 48. The naive stage's token at
    step t is the argmax of the full forward pass over the t tokens before it; one full pass over the
    whole kv-stage answer gives all those argmaxes at once (by induction: if every one of them is the
    kv stage's next token, naive greedy writes the same answer), instead of 128 passes of growing length."""
    ids = tokenizer.apply_chat_template(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    kv = generate(backend_model, tokenizer, ids, params, stage="kv")    # the plain model, or the native one
    assert len(kv.token_ids) == steps
    with torch.inference_mode():                                           # stage 1's pass, at every prefix
        full = model(torch.tensor([ids + kv.token_ids[:-1]]))[0]          # (prompt + steps - 1, vocab)
    naive_tokens = full[len(ids) - 1:].argmax(dim=-1).tolist()
    assert kv.token_ids == naive_tokens


def test_batch_of_different_lengths_gives_each_prompt_its_own_tokens(backend_model, tokenizer):
    model = backend_model
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}]),
               tokenizer.encode("1, 2, 3,"),
               tokenizer.encode("Hi")]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batched = generate_batch(model, tokenizer, prompts, params, stage="kv")
    for p, out in zip(prompts, batched):
        alone = generate(model, tokenizer, p, params, stage="kv")
        assert out.token_ids == alone.token_ids


def test_naive_batch_matches_kv_batch(model, tokenizer):
    prompts = [tokenizer.encode("Once upon a time"), tokenizer.encode("The sky is blue because")]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = generate_batch(model, tokenizer, prompts, params, stage="naive")
    b = generate_batch(model, tokenizer, prompts, params, stage="kv")
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
