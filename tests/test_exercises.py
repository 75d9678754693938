"""The exercise checks: they pass minillm's own answers, and tell a learner what is wrong with a wrong one."""
import math

import torch

from minillm.course.exercises import check_min_p, check_top_p
from minillm.sampling import min_p_filter, top_p_filter


def test_the_reference_answers_pass(capsys):
    assert check_top_p(top_p_filter) and check_min_p(min_p_filter)
    assert "5 of 5 checks pass" in capsys.readouterr().out


def test_an_unwritten_answer_says_so_in_one_line(capsys):
    def stub(logits, p):
        raise NotImplementedError
    assert not check_top_p(stub)
    assert capsys.readouterr().out.strip() == ("✗ your top-p filter is not written yet: replace "
                                               "`raise NotImplementedError` with your code")


def test_a_top_p_that_drops_the_crossing_token_gets_a_hint(capsys):
    def off_by_one(logits, p):
        probs, order = torch.softmax(logits, -1).sort(descending=True)
        drop = probs.cumsum(-1) > p                                   # drops the token that crosses p
        return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    assert not check_top_p(off_by_one)
    assert "keep the token whose probability crosses p" in capsys.readouterr().out


def test_in_place_changes_and_errors_are_reported(capsys):
    def in_place(logits, min_p):
        logits[:, 0] = 0.0
        return min_p_filter(logits, min_p)

    def broken(logits, min_p):
        return logits.nosuchmethod()
    assert not check_min_p(in_place)
    assert "changed in place" in capsys.readouterr().out
    assert not check_min_p(broken)
    out = capsys.readouterr().out
    assert "raised AttributeError" in out and "nosuchmethod" in out


def test_a_kv_size_that_ignores_the_windows_gets_a_hint(capsys):
    from minillm.course.exercises import check_kv_bytes

    def every_layer_full(cfg, tokens, bytes_per_value, windows):
        return tokens * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * bytes_per_value
    assert not check_kv_bytes(every_layer_full)
    out = capsys.readouterr().out
    assert "✓ SmolLM2, every layer full" in out and "a windowed layer keeps only its last tokens" in out
    assert "against every layer full" not in out                 # the summary waits for a right answer


def test_a_merge_that_forgets_its_lse_or_divides_zero_by_zero_is_named(capsys):
    from minillm.course.exercises import check_merge_states

    def keeps_the_larger_lse(o1, lse1, o2, lse2):     # the output is right; the lse cannot be merged again
        m = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None], m
    assert not check_merge_states(keeps_the_larger_lse)
    out = capsys.readouterr().out
    assert "the merged lse is off" in out and "nan" in out     # and -inf - -inf = nan on two empty sides


def test_a_gqa_decode_that_copies_or_tiles_the_heads_is_named(capsys):
    from minillm.attention import naive_attention
    from minillm.course.exercises import check_gqa_decode

    assert not check_gqa_decode(naive_attention)                # right numbers, but it repeats K and V
    assert "K and V must be read where they are" in capsys.readouterr().out

    def tiled(q, k, v):                                          # head h reads KV head h % n_kv
        B, H, _, hd = q.shape
        qg = q.view(B, H // k.shape[1], k.shape[1], hd).transpose(1, 2)          # (B, n_kv, group, hd)
        probs = torch.softmax(qg @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        return (probs @ v).transpose(1, 2).reshape(B, H, 1, hd)
    assert not check_gqa_decode(tiled)
    assert "h // group" in capsys.readouterr().out

    from minillm.attention import gqa_attention
    assert not check_gqa_decode(gqa_attention)                  # the notebook's own answer, called
    assert "a finished attention" in capsys.readouterr().out
    assert not check_gqa_decode(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert "a finished attention" in capsys.readouterr().out


def test_the_sampling_explorer_redraws_when_a_slider_moves(model, tokenizer):
    from minillm.course.widgets import SamplingExplorer, describe

    ex = SamplingExplorer(model, tokenizer, tokenizer.encode("Once upon a time, there was a little"), max_tokens=8)
    first = (ex.kept, ex.text)
    assert "drawn in" in ex.status.value and describe(ex.params) in ex.status.value
    ex.sliders["temperature"].value = 0.3 + 0.1 + 0.1    # float noise, as a slider makes it ...
    assert ex.params.temperature == 0.5 and "T 0.50" in ex.status.value   # ... is not shown
    ex.sliders["top_p"].value = 0.5
    ex.sliders["min_p"].value = 0.2
    assert ex.text != first[1] and ex.kept < first[0] and ex.params.min_p == 0.2
    ex.sliders["temperature"].value = 0.0                  # the slider reaches greedy: one token kept
    assert ex.params.greedy and ex.kept == 1 and "T 0 (greedy)" in ex.status.value


def _answers():
    import math

    import torch.nn.functional as F

    from minillm.course.exercises.kv_cache import reference_kv_append
    from minillm.course.exercises.model import reference_causal_attention

    def online(m, l, acc, s, v):                    # the notebook's answer: a tile of rows at once
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - m_safe), torch.exp(s - m_safe[:, None])
        return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v

    def merge(o1, lse1, o2, lse2):
        m = torch.maximum(lse1, lse2)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        total = w1 + w2
        return (w1[:, None] * o1 + w2[:, None] * o2) / torch.where(total > 0, total, 1.0)[:, None], m + torch.log(total)

    def gqa_decode(q, k, v):
        B, H, _, hd = q.shape
        qg = q.view(B, k.shape[1], H // k.shape[1], hd)
        return (torch.softmax(qg @ k.transpose(-2, -1) / math.sqrt(hd), -1) @ v).view(B, H, 1, hd)

    return {"check_rms_norm": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
            "check_causal_attention": reference_causal_attention,
            "check_kv_append": reference_kv_append,
            "check_kv_bytes": lambda cfg, t, b, windows: sum(t if w is None else min(t, w) for w in windows)
                                                   * cfg.n_kv_heads * cfg.head_dim * 2 * b,
            "check_gqa_decode": gqa_decode,
            "check_online_softmax": online,
            "check_merge_states": merge,
            "check_slot_lookup": lambda t, bs, p: t[p // bs] * bs + p % bs,
            "check_blocks_needed": lambda n, k, bs: -(-(n + k) // bs) - -(-n // bs),
            **_engine_answers()}


def _engine_answers():
    """Notebooks 07-12: the answers as the notebooks show them."""
    import json

    from minillm.kv.prefix_cache import hash_block

    def decode_steps(answers, slots, policy):
        if policy == "static":
            return sum(max(answers[i:i + slots]) for i in range(0, len(answers), slots))
        waiting, running, steps = list(answers), [], 0
        while waiting or running:
            while waiting and len(running) < slots:
                running.append(waiting.pop(0))
            running = [left - 1 for left in running if left > 1]
            steps += 1
        return steps

    def pack(requests):
        positions, k_lens, logit_rows = [], [], []
        for computed, new, total in requests:
            positions += range(computed, computed + new)
            k_lens.append(computed + new)
            if computed + new == total:
                logit_rows.append(len(positions) - 1)
        return positions, k_lens, logit_rows

    def chunk_plan(prompt_lens, budget, decodes):
        left, plan = list(prompt_lens), []
        while any(left):
            room, step = budget - decodes, {}
            for i in range(len(left)):
                if room == 0:
                    break
                if left[i] == 0:              # its prompt is done: it decodes, one token
                    room -= 1
                    continue
                step[i] = min(left[i], room)
                left[i] -= step[i]
                room -= step[i]
            plan.append(step)
        return plan

    def chain(ids, bs):
        out = []
        for i in range(len(ids) // bs):
            out.append(hash_block(out[-1] if out else None, ids[i * bs:(i + 1) * bs]))
        return out

    def cached_tokens(addresses, cached, n, bs):
        hits = 0
        for address in addresses[:(n - 1) // bs]:
            if address not in cached:
                break
            hits += 1
        return hits * bs

    def verify(drafts, target):
        out = []
        for x, t in zip(drafts, target):
            if x != t:
                break
            out.append(x)
        return out + [target[len(out)]]

    def parse_sse(lines):
        text = ""
        for line in lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: "):])
            text += "".join(c["text"] for c in chunk["choices"])
        return text

    def pct(values, q):
        v = sorted(values)
        pos = (len(v) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    def int8_rows(w):
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        return torch.round(w / scale[:, None]).to(torch.int8), scale

    def q4_1(raw):
        out, blocks, _ = raw.shape
        d, m = (raw[..., a:a + 2].contiguous().view(torch.float16).float() for a in (0, 2))   # (out, blocks, 1)
        q = torch.cat([raw[..., 4:] & 0x0F, raw[..., 4:] >> 4], dim=-1).float()               # (out, blocks, 32)
        return (q * d + m).view(out, blocks * 32)

    def qkv_shard(w, n_heads, n_kv, hd, rank, world):
        h, kv = n_heads // world, n_kv // world
        q = w[rank * h * hd:(rank + 1) * h * hd]
        k = w[(n_heads + rank * kv) * hd:(n_heads + (rank + 1) * kv) * hd]
        v = w[(n_heads + n_kv + rank * kv) * hd:(n_heads + n_kv + (rank + 1) * kv) * hd]
        return torch.cat([q, k, v])

    def transfer(n, bs, layers, n_kv, hd, nbytes):
        return 2 * layers * ((n - 1) // bs * bs) * n_kv * hd * nbytes

    def lookup_speedup(tokens_per_pass, k_run, k, pass_cost):
        from minillm.course.speculative_bench import alpha_from_tokens_per_pass
        from minillm.speculative import expected_tokens_per_step
        return expected_tokens_per_step(alpha_from_tokens_per_pass(tokens_per_pass, k_run), k) / pass_cost[k + 1]

    def rope_interleaved(x, cos, sin):
        return (x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).to(x.dtype)

    def step_split(events, wall):
        parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for name, parents, ms in events:
            chain = (name, *parents)
            if any("scaled_dot_product" in n for n in chain) or (name == "aten::index_select"
                                                                  and "aten::embedding" not in chain):
                parts["attention"] += ms
            elif any(n.endswith(("mm", "linear", "mm_for_cpu")) for n in chain):
                parts["matmul"] += ms
            else:
                parts["other"] += ms
        return parts | {"python": wall - sum(parts.values())}

    return {"check_qkv_shard": qkv_shard, "check_transfer_bytes": transfer, "check_decode_steps": decode_steps, "check_pack": pack, "check_chunk_plan": chunk_plan,
            "check_chunk_mask": lambda start, n: torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start),
            "check_chain": chain, "check_cached_tokens": cached_tokens, "check_verify_greedy": verify,
            "check_parse_sse": parse_sse, "check_percentile": pct,
            "check_int8_rows": int8_rows, "check_read_q4_1": q4_1,
            "check_rope_interleaved": rope_interleaved, "check_lookup_speedup": lookup_speedup, "check_step_split": step_split}


def test_every_exercise_passes_its_answer_and_fails_a_stub(capsys):
    import minillm.course.exercises as ex

    answers = _answers()
    elsewhere = {"check_top_p", "check_min_p",                                      # above
                 "check_lru", "check_ring_all_reduce",                              # test_exercises_build.py
                 "check_schedule", "check_accept_draft",                            # test_exercises_engine_pieces.py
                 "check_prediction", "check_ridge_batch",                           # test_course_logic.py
                 "check_attention_in_model", "check_kv_append_in_model",            # test_exercises_in_model.py
                 "check_online_tile_in_model",
                 "check_schedule_in_engine", "check_verify_in_engine",
                 "check_block_pool", "check_block_pool_in_engine",
                 "check_decode_kernel", "check_decode_kernel_in_model"}
    assert set(answers) | elsewhere == {n for n in ex.__all__ if n.startswith("check_")}
    for name, answer in answers.items():
        assert getattr(ex, name)(answer), name

        def stub(*args):
            raise NotImplementedError
        assert not getattr(ex, name)(stub), name
        assert "not written yet" in capsys.readouterr().out.splitlines()[-1]


def test_engine_exercises_say_what_is_wrong(capsys):
    from minillm.course.exercises import check_cached_tokens, check_read_q4_1

    def all_full_blocks(addresses, cached, n, bs):           # forgets that the last token must be computed
        hits = next((i for i, a in enumerate(addresses) if a not in cached), len(addresses))
        return hits * bs
    assert not check_cached_tokens(all_full_blocks)
    assert "the last token must be computed" in capsys.readouterr().out

    def interleaved(raw):                                    # reads a byte's two nibbles as neighbours
        out, blocks, _ = raw.shape
        d, m = (raw[..., a:a + 2].contiguous().view(torch.float16).float() for a in (0, 2))   # (out, blocks, 1)
        q = torch.stack([raw[..., 4:] & 0x0F, raw[..., 4:] >> 4], -1).reshape(out, blocks, 32).float()
        return (q * d + m).view(out, blocks * 32)
    assert not check_read_q4_1(interleaved)
    assert "low nibble" in capsys.readouterr().out

    def scales_swapped(raw):                                 # m first, then d
        out, blocks, _ = raw.shape
        m, d = (raw[..., a:a + 2].contiguous().view(torch.float16).float() for a in (0, 2))
        q = torch.cat([raw[..., 4:] & 0x0F, raw[..., 4:] >> 4], -1).float()
        return (q * d + m).view(out, blocks * 32)
    assert not check_read_q4_1(scales_swapped)
    assert "first 4 bytes" in capsys.readouterr().out



def test_distributed_exercises_say_what_is_wrong(capsys):
    from minillm.course.exercises import check_qkv_shard, check_transfer_bytes

    def contiguous(w, n_heads, n_kv, hd, rank, world):       # a slice of the fused rows, kinds mixed
        n = (n_heads + 2 * n_kv) * hd // world
        return w[rank * n:(rank + 1) * n]
    assert not check_qkv_shard(contiguous)
    assert "q heads | k heads | v heads" in capsys.readouterr().out

    assert not check_transfer_bytes(lambda n, bs, layers, n_kv, hd, nbytes: 2 * layers * n * n_kv * hd * nbytes)
    assert "only full blocks travel" in capsys.readouterr().out


def test_step_exercises_say_what_is_wrong(capsys):
    from minillm.course.exercises import check_rope_interleaved, check_step_split

    def halves(x, cos, sin):                                 # rotate-half's pairing, not neighbours
        return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
    assert not check_rope_interleaved(halves)
    assert "pairs with" in capsys.readouterr().out

    def glued(x, cos, sin):                                  # right, by taking the pairs apart and stacking them
        a, b = x[..., 0::2], x[..., 1::2]
        return (x * cos + torch.stack((b, a), dim=-1).flatten(-2) * sin).to(x.dtype)
    assert not check_rope_interleaved(glued)
    assert "it calls stack" in capsys.readouterr().out

    def by_name_only(events, wall):                          # ignores what an operator runs inside
        parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for name, _, ms in events:
            parts["matmul" if name.endswith("mm") else "attention" if "scaled" in name else "other"] += ms
        return parts | {"python": wall - sum(parts.values())}
    assert not check_step_split(by_name_only)
    assert "attention" in capsys.readouterr().out


def test_a_lookup_speedup_that_carries_the_wrong_number_over_is_named(capsys):
    from minillm.course.exercises import check_lookup_speedup

    assert not check_lookup_speedup(lambda tpp, k_run, k, cost: min(tpp, k + 1) / cost[k + 1])
    assert "tokens per pass depend on k" in capsys.readouterr().out
    assert not check_lookup_speedup(lambda tpp, k_run, k, cost: (1 + (tpp - 1) / k_run * k) / cost[k + 1])
    assert "the share of drafts accepted falls as k grows" in capsys.readouterr().out
