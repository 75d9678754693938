"""Quantized KV cache: values come back within half a quantization step, the caches and the block pool
store and return them like float ones (views, copy-on-write, gathers), they take the bytes they
promise, and the model's next-token distribution moves no more than measured."""
import pytest
import torch
from helpers import pool_io
from helpers.engine_check import assert_engine_matches_solo

import minillm
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.kv import BlockPool, KVCache, kv_cache_bytes
from minillm.kv.quantized import GROUP4, QuantizedKV, dequantize, quantize
from minillm.course.quality import KV_KL_BOUND, compare, heldout_ids, next_token_logprobs
from minillm.sampling import SamplingParams


@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 7, 64), (1, 32), (9, 2, 96)])
def test_values_come_back_within_half_a_step(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x[..., 1] *= 20                                                     # an outlier channel
    codes, s = quantize(x, "int8")
    assert codes.dtype == torch.int8 and s.shape == (*shape[:-1], 1)
    assert ((dequantize(codes, s, "int8", torch.float32) - x).abs() <= s.float() / 2 + 1e-3 * x.abs()).all()
    codes, s = quantize(x, "int4")
    assert codes.shape == (*shape[:-1], shape[-1] // 2) and codes.dtype == torch.uint8
    d = s.view(*shape[:-1], -1, 2)[..., 0].float().repeat_interleave(GROUP4, -1)   # each value's step
    err = (dequantize(codes, s, "int4", torch.float32) - x).abs()
    assert (err <= d / 2 + 2e-3 * x.abs().amax(-1, keepdim=True)).all()    # + float16 rounding of d and m


def test_int4_nibbles_hold_neighbouring_values():
    x = torch.arange(32.0).view(1, 32)                                   # codes 0..15 twice over the group's range
    codes, s = quantize(x, "int4")
    q = torch.round((x - 0) / (31 / 15)).to(torch.uint8)
    assert torch.equal(codes & 0x0F, q[:, 0::2]) and torch.equal(codes >> 4, q[:, 1::2])


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_contiguous_cache_stores_quantized_and_returns_values(model, kv):
    cfg = model.cfg
    cache = KVCache(cfg, 2, 40, kv_dtype=kv)
    ref = KVCache(cfg, 2, 40, torch.float16)
    assert cache.nbytes / ref.nbytes < (0.52 if kv == "int8" else 0.32)
    assert cache.nbytes == kv_cache_bytes(cfg, 2 * 40, torch.float16, kv)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, cfg.n_kv_heads, 5, cfg.head_dim, generator=g) for _ in range(2))
    cache.begin(5)
    k_all, v_all = cache.update(3, k, v)
    assert k_all.shape == k.shape and k_all.dtype == torch.float32
    assert (k_all - k).abs().max() < (0.05 if kv == "int8" else 0.5)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_block_pool_writes_forks_and_gathers_quantized_blocks(model, kv):
    cfg = model.cfg
    pool = BlockPool(cfg, num_blocks=6, block_size=4, kv_dtype=kv)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(6, cfg.n_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
    slots = pool.allocate(0, 6)
    pool_io.write(pool, 2, slots, k, v)
    k_back, v_back = pool_io.gather(pool, 2, 0)
    expect_k = dequantize(*quantize(k, kv), kv, torch.float32)
    assert torch.equal(k_back, expect_k)
    pool.fork(0, 1)
    pool.grow(1, 1)                                          # the shared partial block is copied first
    assert pool.tables[0][-1] != pool.tables[1][-1]
    k1, _ = pool_io.gather(pool, 2, 1)
    assert torch.equal(k1[:6], expect_k)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_kv_quality_within_bound(model, tokenizer, kv):
    ids = heldout_ids(tokenizer, max_tokens=256)
    q = compare(next_token_logprobs(model, ids), next_token_logprobs(model, ids, kv), ids)
    assert q["kl"] < KV_KL_BOUND[kv], q


TEXTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time, in a land far away, there lived a",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_engine_with_int8_kv_batches_chunks_and_preempts_without_changing_tokens(tokenizer):
    engine = assert_engine_matches_solo(minillm.load_model(), tokenizer, TEXTS, GREEDY, kv_cache_dtype="int8")
    assert engine.pool.kv_dtype == "int8"


def test_bad_kv_dtype_and_unsupported_stage_say_what_to_do(tokenizer):
    m = minillm.load_model()
    with pytest.raises(ValueError, match="int8 or int4"):
        generate(m, tokenizer, [1, 2, 3], GREEDY, stage="kv", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv, flash, paged and continuous"):
        generate(m, tokenizer, [1, 2, 3], GREEDY, stage="naive", kv_cache_dtype="int4")


@pytest.mark.triton
@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_triton_kernels_read_quantized_pages_like_their_dequantized_values(kv):
    """The prefill (varlen) and decode kernels, fed codes and scales, equal the same kernels fed the
    dequantized cache: tiles are dequantized as they are loaded (interpreter, float32)."""
    from minillm.attention.triton_flash import decode_attention, flash_attn_varlen

    g = torch.Generator().manual_seed(3)
    nb, bs, H, H_kv, D = 7, 4, 6, 2, 64
    k_pool = QuantizedKV.zeros((nb, bs, H_kv, D), kv, torch.float32, "cpu")
    v_pool = QuantizedKV.zeros((nb, bs, H_kv, D), kv, torch.float32, "cpu")
    k_pool[:] = torch.randn(nb, bs, H_kv, D, generator=g)
    v_pool[:] = torch.randn(nb, bs, H_kv, D, generator=g)
    k_f, v_f = k_pool.dequantize(), v_pool.dequantize()                      # (nb, bs, H_kv, D)
    table = torch.tensor([[3, 0, 5, 1], [6, 2, 4, 0]], dtype=torch.int32)    # ragged: 13 and 6 keys
    k_lens, q_lens = [13, 6], [3, 1]
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 13, 19], dtype=torch.int32)
    q = torch.randn(4, H, D, generator=g)
    got = flash_attn_varlen(q, k_pool, v_pool, cu_q, cu_k, max(q_lens), max(k_lens), block_table=table, block_n=16)
    ref = flash_attn_varlen(q, k_f, v_f, cu_q, cu_k, max(q_lens), max(k_lens), block_table=table, block_n=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    qd = torch.randn(2, H, D, generator=g)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    got = decode_attention(qd, k_pool, v_pool, lens, block_table=table, block_n=16)
    ref = decode_attention(qd, k_f, v_f, lens, block_table=table, block_n=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    kc = QuantizedKV.zeros((2, 16, H_kv, D), kv, torch.float32, "cpu")      # contiguous (B, max_len, H_kv, D)
    vc = QuantizedKV.zeros((2, 16, H_kv, D), kv, torch.float32, "cpu")
    kc[:], vc[:] = torch.randn(2, 16, H_kv, D, generator=g), torch.randn(2, 16, H_kv, D, generator=g)
    got = decode_attention(qd, kc, vc, lens, block_n=16)
    torch.testing.assert_close(got, decode_attention(qd, kc.dequantize(), vc.dequantize(), lens, block_n=16),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_engine_triton_backend_reads_an_int8_cache(tokenizer):
    m = minillm.load_model()
    prompts = [tokenizer.encode(t) for t in TEXTS[:2]]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(m, tokenizer, attention=backend, kv_cache_memory=16 << 20, kv_cache_dtype="int8")
        for i, p in enumerate(prompts):
            engine.add_request(i, p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[backend, out.request_id] = out.token_ids
    assert [outs["triton", i] for i in range(2)] == [outs["torch", i] for i in range(2)]
