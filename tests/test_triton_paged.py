"""Paged attention under the Triton interpreter: block tables shuffled and interleaved with a
"blocker" sequence so pages are never contiguous; ragged lengths at and across block boundaries."""
import pytest
import torch

from minillm.attention import naive_attention
from minillm.attention.triton_paged import (decode_attention, flash_attn_varlen, paged_decode_reference,
                                            write_kv_to_slots)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def interleaved_tables(lengths, block_size, generator):
    """Block tables for `lengths`, each sequence's blocks alternating with a blocker's and shuffled."""
    need = [-(-n // block_size) for n in lengths]
    total = 2 * sum(need) + 2
    perm = torch.randperm(total, generator=generator)
    ours = perm[: sum(need)]                                   # the blocker gets the rest
    tables, i = [], 0
    for n in need:
        tables.append(ours[i:i + n])
        i += n
    width = max(need)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    return table, total


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("lengths", [[1], [16, 17, 15], [32, 95, 64, 3]])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_matches_reference(block_size, lengths, group, dtype):
    g = torch.Generator().manual_seed(block_size * 1000 + sum(lengths) + group)
    table, num_blocks = interleaved_tables(lengths, block_size, g)
    H_kv, D = 2, 64
    kc, vc = (torch.randn(num_blocks, block_size, H_kv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lengths), H_kv * group, D, generator=g).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, lens, block_table=table, out=out)
    assert not out.isnan().any()
    ref = paged_decode_reference(q.double(), kc.double(), vc.double(), lens, table)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_reference_gathers_the_right_pages():
    """The reference itself against a contiguous copy built by hand."""
    g = torch.Generator().manual_seed(0)
    table, nb = interleaved_tables([20], 8, g)
    kc, vc = (torch.randn(nb, 8, 1, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k = torch.cat([kc[int(p)] for p in table[0]])[:20]
    v = torch.cat([vc[int(p)] for p in table[0]])[:20]
    q = torch.randn(1, 2, 4, generator=g, dtype=torch.float64)
    expected = naive_attention(q[:, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[:, :, 0]
    torch.testing.assert_close(paged_decode_reference(q, kc, vc, torch.tensor([20]), table), expected)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("new, cached", [([5, 1], [11, 16]), ([16, 9], [0, 23])])
def test_paged_prefill_over_a_cached_prefix(block_size, new, cached):
    g = torch.Generator().manual_seed(block_size + sum(new) + sum(cached))
    total = [n + c for n, c in zip(new, cached)]
    table, nb = interleaved_tables(total, block_size, g)
    H_kv, group, D = 2, 3, 64
    kc, vc = (torch.randn(nb, block_size, H_kv, D, generator=g) for _ in range(2))
    q = torch.randn(sum(new), H_kv * group, D, generator=g)
    cu_q = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(total).cumsum(0)), dtype=torch.int32)
    out = flash_attn_varlen(q, kc, vc, cu_q, cu_k, max(new), max(total), causal=True, block_table=table)
    i = 0
    for b, (n, t) in enumerate(zip(new, total)):
        pages = table[b, : -(-t // block_size)].long()
        k = kc[pages].reshape(-1, H_kv, D)[:t].double()
        v = vc[pages].reshape(-1, H_kv, D)[:t].double()
        ref = naive_attention(q[i:i + n].double().transpose(0, 1)[None], k.transpose(0, 1)[None],
                              v.transpose(0, 1)[None])[0].transpose(0, 1)
        torch.testing.assert_close(out[i:i + n].double(), ref, **TOL[torch.float32])
        i += n


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kv_to_slots(block_size):
    g = torch.Generator().manual_seed(block_size)
    kc, vc = torch.zeros(6, block_size, 3, 64), torch.zeros(6, block_size, 3, 64)
    slots = torch.randperm(6 * block_size, generator=g)[:10]
    k, v = torch.randn(10, 3, 64, generator=g), torch.randn(10, 3, 64, generator=g)
    write_kv_to_slots(k, v, kc, vc, slots)
    torch.testing.assert_close(kc.view(-1, 3, 64)[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(vc.view(-1, 3, 64)[slots], v, rtol=0, atol=0)
    untouched = torch.ones(6 * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (kc.view(-1, 3, 64)[untouched] == 0).all()


def test_paged_stage_gives_the_naive_greedy_tokens(model, tokenizer):
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    paged = generate(model, tokenizer, ids, params, stage="paged")
    assert paged.token_ids == generate(model, tokenizer, ids, params, stage="naive").token_ids


def test_paged_batch_of_different_lengths_matches_each_alone(tokenizer):
    """Prompts of 5, 9 and 17 tokens with 16-token blocks: pages of different sequences interleave. The
    pages' bookkeeping, so a tiny random model does (the real model's tokens: the test above; the
    tokenizer only turns its ids into text)."""
    from minillm.generate import generate_batch
    from minillm.sampling import SamplingParams
    from test_paged_torch import tiny_model

    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 9, 17)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)                # 17 + 20 crosses two blocks
    together = generate_batch(model, tokenizer, prompts, params, stage="paged")
    for p, out in zip(prompts, together):
        assert out.token_ids == generate_batch(model, tokenizer, [p], params, stage="naive")[0].token_ids


def test_gpu_benchmark_script_runs_in_smoke_mode(tmp_path):
    """benchmarks/flash_attention.py is meant for a GPU; --smoke checks it end to end anywhere."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "flash_attention.py")
    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, script, "--smoke", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["prefill"] and report["decode"] and report["paged_decode"]
    assert report["paged_decode"][0]["max_abs_diff_paged_vs_contiguous"] < 1e-5
