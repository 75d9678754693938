"""Stage 3 kernels under the Triton interpreter (conftest sets TRITON_INTERPRET=1 before triton loads),
checked against a float64 torch reference on fresh random inputs."""
import os
import subprocess
import sys

import pytest
import torch

from minillm.attention import naive_attention
from minillm.attention.tiled import tiled_attention
from minillm.attention.triton_flash import decode_attention, flash_attn_varlen

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def reference_varlen(q, k, v, lens_q, lens_k, causal):
    """Each sequence through naive attention in float64, packed back."""
    outs, iq, ik = [], 0, 0
    for tq, tk in zip(lens_q, lens_k):
        qs = q[iq:iq + tq].double().transpose(0, 1)[None]     # (1, H, tq, D)
        ks = k[ik:ik + tk].double().transpose(0, 1)[None]     # (1, H_kv, tk, D)
        vs = v[ik:ik + tk].double().transpose(0, 1)[None]
        mask = None if causal else torch.ones(tq, tk, dtype=torch.bool)
        o = naive_attention(qs, ks, vs, mask)[0].transpose(0, 1)  # (tq, H, D)
        if causal and tk < tq:   # queries before the first key see nothing: flash-attn writes 0
            o[: tq - tk] = 0
        outs.append(o)
        iq, ik = iq + tq, ik + tk
    return torch.cat(outs)


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


CASES = [  # (query lengths, key lengths): ragged, not multiples of the block, 1, cached prefixes
    ([1], [1]),
    ([5, 64, 65, 17], [5, 64, 65, 17]),
    ([130], [130]),
    ([3, 1, 20], [10, 7, 84]),           # new tokens after a cached prefix (chunked prefill)
    ([1, 1, 1], [1, 33, 128]),
]


@pytest.mark.parametrize("lens_q, lens_k", CASES)
@pytest.mark.parametrize("group, D", [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_varlen_matches_reference(lens_q, lens_k, group, D, dtype):
    g = torch.Generator().manual_seed(sum(lens_q) * 7 + group + D)
    H_kv = 2
    q = torch.randn(sum(lens_q), H_kv * group, D, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens_k), H_kv, D, generator=g).to(dtype) for _ in range(2))
    out = torch.full_like(q, float("nan"))               # poison: every element must be written
    flash_attn_varlen(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True, out=out)
    assert not out.isnan().any(), "the kernel left elements unwritten"
    expected = reference_varlen(q, k, v, lens_q, lens_k, causal=True)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 64)])
def test_flash_varlen_non_causal_and_other_blocks(block_m, block_n):
    g = torch.Generator().manual_seed(block_m + block_n)
    lens_q, lens_k = [7, 40], [19, 40]
    q = torch.randn(sum(lens_q), 6, 64, generator=g)
    k, v = (torch.randn(sum(lens_k), 2, 64, generator=g) for _ in range(2))
    out = flash_attn_varlen(q, k, v, cu(lens_q), cu(lens_k), 40, 40, causal=False, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out.double(), reference_varlen(q, k, v, lens_q, lens_k, causal=False),
                               **TOL[torch.float32])


def test_flash_varlen_softmax_scale():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 64, generator=g) for _ in range(3))
    a = flash_attn_varlen(q, k, v, cu([9]), cu([9]), 9, 9, softmax_scale=0.5)
    b = flash_attn_varlen(q * (0.5 * 8), k, v, cu([9]), cu([9]), 9, 9)  # default scale is 1/sqrt(64) = 1/8
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqlens", [[1], [63, 64, 65], [200, 1, 129]])
@pytest.mark.parametrize("group, D", [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_matches_reference(seqlens, group, D, dtype, num_splits):
    g = torch.Generator().manual_seed(sum(seqlens) + group * 10 + D)
    B, H_kv, max_len = len(seqlens), 2, max(seqlens) + 5
    q = torch.randn(B, H_kv * group, D, generator=g).to(dtype)
    kc, vc = (torch.randn(B, max_len, H_kv, D, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor(seqlens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, lens, num_splits=num_splits, out=out)
    assert not out.isnan().any()
    for b, n in enumerate(seqlens):
        ref = naive_attention(q[b, :, None].double()[None], kc[b, :n].double().transpose(0, 1)[None],
                              vc[b, :n].double().transpose(0, 1)[None])[0, :, 0]   # (H, D)
        torch.testing.assert_close(out[b].double(), ref, **TOL[dtype])


@pytest.mark.parametrize("batch, longest, splits", [(1, 40, 1), (1, 8192, 88), (64, 8192, 2), (1, 65, 2)])
def test_decode_splits_come_from_the_real_lengths(batch, longest, splits):
    """On an H200 (132 SMs): enough slices for about 2 programs per SM, never more than the longest
    sequence's tiles of 64 keys. A 40-token cache is one slice however many slots it has."""
    from minillm.attention.triton_flash import default_num_splits

    assert default_num_splits(batch, 3, longest, 64, torch.device("cuda"), sm_count=132) == splits


@pytest.mark.parametrize("paged", [False, True])
def test_a_short_cache_in_a_long_buffer_is_split_by_its_length(monkeypatch, paged):
    from minillm.attention import triton_flash

    asked = []
    real = triton_flash.default_num_splits
    monkeypatch.setattr(triton_flash, "default_num_splits", lambda *a, **k: asked.append(a[2]) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 9, 64, generator=g)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    if paged:   # 2 sequences x 64 pages of 16 slots: 1,024 slots each, in a shuffled pool
        kc, vc = (torch.randn(128, 16, 3, 64, generator=g) for _ in range(2))
        table = torch.randperm(128, generator=g).to(torch.int32).view(2, 64)
        rows = lambda c, b, n: c[table[b].long()].flatten(0, 1)[:n]        # noqa: E731
    else:
        kc, vc = (torch.randn(2, 1024, 3, 64, generator=g) for _ in range(2))
        table, rows = None, lambda c, b, n: c[b, :n]                        # noqa: E731
    out = decode_attention(q, kc, vc, lens, block_table=table)
    assert asked == [40]                                  # read from cache_seqlens: not the 1,024 slots
    decode_attention(q, kc, vc, lens, block_table=table, max_seqlen_k=40)
    assert asked == [40, 40]
    for b, n in enumerate([40, 7]):
        ref = naive_attention(q[b, :, None].double()[None], rows(kc, b, n).double().transpose(0, 1)[None],
                              rows(vc, b, n).double().transpose(0, 1)[None])[0, :, 0]
        torch.testing.assert_close(out[b].double(), ref, **TOL[torch.float32])


def test_decode_reads_a_strided_cache_view():
    """The model's cache is (B, H_kv, max_len, D); a permuted view must work without a copy."""
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 3, 50, 64, generator=g)       # (B, H_kv, max_len, D)
    q = torch.randn(2, 9, 64, generator=g)
    lens = torch.tensor([50, 21], dtype=torch.int32)
    view = cache.permute(0, 2, 1, 3)                      # (B, max_len, H_kv, D), strided
    out = decode_attention(q, view, view, lens)
    ref = torch.stack([naive_attention(q[b, :, None][None], cache[b:b + 1, :, :n], cache[b:b + 1, :, :n])[0, :, 0]
                       for b, n in enumerate([50, 21])])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, S", [(1, 1), (5, 5), (70, 70), (3, 100), (130, 130)])
@pytest.mark.parametrize("group", [1, 3])
def test_tiled_attention_matches_naive(T, S, group):
    g = torch.Generator().manual_seed(T + S + group)
    q = torch.randn(2, 2 * group, T, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, S, 32, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(tiled_attention(q, k, v, block_m=32, block_n=16), naive_attention(q, k, v))


def test_clear_error_on_cpu_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch; from minillm.attention.triton_flash import decode_attention; "
            "q = torch.randn(1, 3, 64); c = torch.randn(1, 8, 3, 64); "
            "decode_attention(q, c, c, torch.tensor([8], dtype=torch.int32))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr.splitlines()[-1]


def test_flash_stage_gives_the_naive_greedy_tokens(model, tokenizer):
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    flash = generate(model, tokenizer, ids, params, stage="flash")
    assert flash.token_ids == generate(model, tokenizer, ids, params, stage="naive").token_ids
    assert "Paris" in flash.text


def test_flash_stage_batch_of_different_lengths(tokenizer):
    """Ragged prompts in one batch (the padding and per-sequence lengths): a tiny random model does."""
    from minillm.generate import generate_batch
    from minillm.sampling import SamplingParams
    from test_paged_torch import tiny_model

    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 3, 11)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    flash = generate_batch(model, tokenizer, prompts, params, stage="flash")
    naive = generate_batch(model, tokenizer, prompts, params, stage="naive")
    assert [o.token_ids for o in flash] == [o.token_ids for o in naive]


def test_kernels_compile_for_a_hopper_gpu_without_one():
    """The interpreter runs the kernels' Python; this lowers them to real GPU code (sm_90)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "helpers", "aot_compile.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(" OK ") == 14
    unspecialized = {line.split()[1]: set(line.split()[2:]) for line in r.stdout.splitlines()
                     if line.startswith("unspecialized")}
    assert unspecialized == {"_flash_fwd_kernel": {"s_bt"}, "_decode_split_kernel": {"n_splits", "s_bt"},
                             "_decode_reduce_kernel": {"n_splits"}, "_dequant_matmul_kernel": {"M", "sx_m", "sy_m"}}
