"""The exercises whose answer runs inside the real model or engine: the reference answers reproduce the
stage's greedy tokens, and a wrong answer is caught by the tokens (or the error) it leads to."""
import math

import torch

from minillm.course.exercises import (check_attention_in_model, check_block_pool, check_block_pool_in_engine,
                                      check_kv_append_in_model, check_online_softmax, check_online_tile_in_model,
                                      check_schedule_in_engine, check_verify_in_engine)
from minillm.course.exercises.flash import reference_online_tile
from minillm.course.exercises.engine import _engine_schedule
from minillm.course.exercises.kv_cache import reference_kv_append
from minillm.course.exercises.model import reference_causal_attention
from minillm.generate import generate
from minillm.sampling import SamplingParams
from minillm.speculative import verify_greedy

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _reference(model, tokenizer, text="The capital of France is"):
    prompt = tokenizer.encode(text)
    return prompt, generate(model, tokenizer, prompt, PARAMS, stage="naive").token_ids


def test_attention_in_every_head_gives_the_naive_tokens(model, tokenizer, capsys):
    prompt, want = _reference(model, tokenizer)
    assert check_attention_in_model(reference_causal_attention, model, prompt, want, tokenizer)
    assert "its 8 greedy tokens are the reference's" in capsys.readouterr().out

    def no_mask(q, k, v):                      # every query sees the future
        return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v
    assert not check_attention_in_model(no_mask, model, prompt, want, tokenizer)
    out = capsys.readouterr().out
    assert out.startswith("✗ your causal attention, inside the model: token 0 is") and "reference:" in out


def test_an_online_softmax_tile_drives_a_tiled_attention_in_every_layer(model, tokenizer, capsys):
    prompt, want = _reference(model, tokenizer)
    want = want[:4]                              # enough for blocks of 4 to span several tiles
    assert check_online_tile_in_model(reference_online_tile, model, prompt, want, tokenizer, block=4)
    assert "✓ your online-softmax tile, inside the model" in capsys.readouterr().out

    def forgets_the_earlier_tiles(m, l, acc, s, v):   # each tile starts the sums again: only the last one counts
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - torch.where(torch.isinf(m_new), 0.0, m_new)[:, None])
        return m_new, p.sum(-1), p @ v
    assert not check_online_tile_in_model(forgets_the_earlier_tiles, model, prompt, want, tokenizer, block=4)
    assert "✗ your online-softmax tile, inside the model: token" in capsys.readouterr().out

    def no_guard(m, l, acc, s, v):               # -inf - (-inf) for a row with no key in its first tile
        m_new = torch.maximum(m, s.amax(-1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v
    assert not check_online_softmax(no_guard)
    assert "must keep its state" in capsys.readouterr().out


def test_a_kv_append_drives_stage_2(model, tokenizer, capsys):
    prompt, want = _reference(model, tokenizer)
    assert check_kv_append_in_model(reference_kv_append, model, prompt, want, tokenizer)
    assert "✓ your KV append, inside the model" in capsys.readouterr().out

    def forgets_the_past(k_cache, v_cache, k, v, start):    # attends only this step's keys
        reference_kv_append(k_cache, v_cache, k, v, start)
        return k, v
    assert not check_kv_append_in_model(forgets_the_past, model, prompt, want, tokenizer)
    assert "✗ your KV append, inside the model: token" in capsys.readouterr().out

    def unwritten(k_cache, v_cache, k, v, start):
        raise NotImplementedError
    assert not check_kv_append_in_model(unwritten, model, prompt, want, tokenizer)
    assert "not written yet" in capsys.readouterr().out


def test_a_scheduler_step_drives_the_engine_through_preemptions(model, tokenizer, capsys):
    texts = ["The capital of France is", "1, 2, 3, 4, 5,", "Water boils at"]
    prompts = [tokenizer.encode(t) for t in texts]
    want = [generate(model, tokenizer, p, PARAMS, stage="naive").token_ids for p in prompts]
    small = {"max_num_batched_tokens": 8, "block_size": 4, "num_blocks": 8}
    assert check_schedule_in_engine(_engine_schedule, model, tokenizer, prompts, PARAMS, want, **small)
    out = capsys.readouterr().out
    assert out.startswith("✓ your scheduler drove the engine") and "(0 preemptions)" not in out

    def everything_at_once(running, waiting, budget, max_seqs, free_blocks, block_size):   # ignores the pool
        return [(r[0], r[2]) for r in running] + [(w[0], w[1]) for w in waiting], []
    assert not check_schedule_in_engine(everything_at_once, model, tokenizer, prompts, PARAMS, want, **small)
    assert "✗ your scheduler, driving the engine, led to" in capsys.readouterr().out

    def nothing(running, waiting, budget, max_seqs, free_blocks, block_size):
        return [], []
    assert not check_schedule_in_engine(nothing, model, tokenizer, prompts, PARAMS, want, **small)
    assert "never finish" in capsys.readouterr().out


def test_a_greedy_verification_decides_the_engines_drafts(model, tokenizer, capsys):
    from minillm.engine import LLM

    prompts = [tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,")]
    plain = LLM(model, tokenizer, backend="torch", kv_cache_memory=16 << 20, verbose=False)
    want = [o.token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    spec = LLM(model, tokenizer, backend="torch", kv_cache_memory=16 << 20, speculative="ngram",
               num_speculative_tokens=4, adaptive_speculation=False, verbose=False)
    assert check_verify_in_engine(verify_greedy, spec, prompts, PARAMS, want, tokenizer)
    out = capsys.readouterr().out
    assert out.startswith("✓ your verification kept") and " kept 0 of" not in out

    def skips_the_drafts(drafts, argmax):      # the token after the last draft, the drafts themselves lost
        return [argmax[-1]]
    assert not check_verify_in_engine(skips_the_drafts, spec, prompts, PARAMS, want, tokenizer)
    assert "✗ your verification, inside the engine: request 0 answered" in capsys.readouterr().out
    assert spec.engine.speculator.greedy_rule is verify_greedy         # the engine's own rule is back


def _pool_moves():
    def grow(pool, seq, n):
        table, length, bs = pool.tables[seq], pool.lengths[seq], pool.block_size
        if n > 0 and length % bs and pool.refcount[table[-1]] > 1:
            new = pool.take()
            pool.copy_block(table[-1], new, length % bs)
            pool.release(table[-1])
            table[-1] = new
        while len(table) < -(-(length + n) // bs):
            table.append(pool.take())
        pool.lengths[seq] = length + n

    def fork(pool, parent, child):
        pool.tables[child], pool.lengths[child] = list(pool.tables[parent]), pool.lengths[parent]
        for b in pool.tables[child]:
            pool.refcount[b] += 1

    def free(pool, seq):
        for b in pool.tables.pop(seq):
            pool.release(b)
        del pool.lengths[seq]
    return grow, fork, free


def test_a_block_pool_passes_against_blockpool_and_runs_an_engine(model, tokenizer, capsys):
    grow, fork, free = _pool_moves()
    assert check_block_pool(grow, fork, free)
    assert "6 of 6 checks pass" in capsys.readouterr().out
    prompts = [tokenizer.encode(t) for t in ["The capital of France is", "Water boils at"]]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=0, ignore_eos=True)
    small = {"max_num_batched_tokens": 16, "block_size": 4, "num_blocks": 12}
    assert check_block_pool_in_engine(grow, fork, free, model, tokenizer, prompts, params, 2, **small)
    out = capsys.readouterr().out
    assert out.startswith("✓ your block pool ran the engine: 4 samples") and " 0 copies-on-write" not in out

    def no_copy(pool, seq, n):                  # writes into the shared block the other sample reads
        table, length = pool.tables[seq], pool.lengths[seq]
        while len(table) < -(-(length + n) // pool.block_size):
            table.append(pool.take())
        pool.lengths[seq] = length + n
    assert not check_block_pool(no_copy, fork, free)
    assert "copies the shared, partly full last block: after ('grow', 1, 1)" in capsys.readouterr().out
    assert not check_block_pool_in_engine(no_copy, fork, free, model, tokenizer, prompts, params, 2, **small)
    assert "✗ your block pool, inside the engine: sample" in capsys.readouterr().out

    def leaky_free(pool, seq):                  # forgets the blocks
        del pool.tables[seq], pool.lengths[seq]
    assert not check_block_pool(grow, fork, leaky_free)
    assert "is in 0 tables but its refcount is 1" in capsys.readouterr().out


def test_a_triton_decode_kernel_is_checked_and_runs_every_decode_step(model, tokenizer, capsys):
    import pytest

    triton = pytest.importorskip("triton")
    import triton.language as tl

    from minillm.course.exercises import check_decode_kernel, check_decode_kernel_in_model

    @triton.jit
    def kernel(Q, K, V, O, S, scale, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + pid * D + offs_d)
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc = tl.zeros([D], tl.float32)
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            where = (pid // GROUP) * S * D + cols[:, None] * D + offs_d[None, :]
            k = tl.load(K + where, mask=cols[:, None] < S, other=0.0)
            v = tl.load(V + where, mask=cols[:, None] < S, other=0.0)
            s = tl.where(cols < S, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        tl.store(O + pid * D + offs_d, acc / l_i)

    @triton.jit
    def no_rescale(Q, K, V, O, S, scale, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):   # each tile's own max
        pid = tl.program_id(0)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + pid * D + offs_d)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc = tl.zeros([D], tl.float32)
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            where = (pid // GROUP) * S * D + cols[:, None] * D + offs_d[None, :]
            k = tl.load(K + where, mask=cols[:, None] < S, other=0.0)
            v = tl.load(V + where, mask=cols[:, None] < S, other=0.0)
            s = tl.where(cols < S, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
            p = tl.exp(s - tl.max(s, 0))
            l_i = l_i + tl.sum(p, 0)
            acc = acc + tl.sum(p[:, None] * v, 0)
        tl.store(O + pid * D + offs_d, acc / l_i)

    @triton.jit
    def stub(Q, K, V, O, S, scale, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        raise NotImplementedError

    assert not check_decode_kernel(stub)
    assert "not written yet" in capsys.readouterr().out
    assert check_decode_kernel(kernel)
    assert "5 of 5 checks pass" in capsys.readouterr().out
    assert not check_decode_kernel(no_rescale)
    assert "rescale the running sum" in capsys.readouterr().out
    prompt = tokenizer.encode("The capital of France is")
    want = generate(model, tokenizer, prompt, SamplingParams(max_tokens=4, ignore_eos=True), stage="naive").token_ids
    assert check_decode_kernel_in_model(kernel, model, prompt, want, tokenizer)
    assert "its 4 greedy tokens are the reference's" in capsys.readouterr().out
