"""The exercise checks: they pass minillm's own answers, and tell a learner what is wrong with a wrong one."""
import torch

from minillm.exercises import check_min_p, check_top_p
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


def test_the_sampling_explorer_redraws_when_a_slider_moves(model, tokenizer):
    from minillm.widgets import SamplingExplorer, describe

    ex = SamplingExplorer(model, tokenizer, tokenizer.encode("Once upon a time, there was a little"), max_tokens=8)
    first = (ex.kept, ex.text)
    assert "drawn in" in ex.status.value and describe(ex.params) in ex.status.value
    ex.sliders["temperature"].value = 0.3 + 0.1 + 0.1    # float noise, as a slider makes it ...
    assert ex.params.temperature == 0.5 and "T 0.50" in ex.status.value   # ... is not shown
    ex.sliders["top_p"].value = 0.5
    ex.sliders["min_p"].value = 0.2
    assert ex.text != first[1] and ex.kept < first[0] and ex.params.min_p == 0.2


def _answers():
    import math

    import torch.nn.functional as F

    from minillm.exercises.kv_cache import reference_kv_append
    from minillm.exercises.model import reference_causal_attention

    def online(m, l, acc, s, v):
        m_new = torch.maximum(m, s.max())
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        a, p = torch.exp(m - m_safe), torch.exp(s - m_safe)
        return m_new, l * a + p.sum(), acc * a + p @ v

    def merge(outs, lses):
        w = torch.exp(lses - lses.max())
        return (w[:, None] * outs).sum(0) / w.sum()

    def gqa_decode(q, k, v):
        B, H, _, hd = q.shape
        qg = q.view(B, k.shape[1], H // k.shape[1], hd)
        return (torch.softmax(qg @ k.transpose(-2, -1) / math.sqrt(hd), -1) @ v).view(B, H, 1, hd)

    return {"check_rms_norm": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
            "check_causal_attention": reference_causal_attention,
            "check_kv_append": reference_kv_append,
            "check_kv_bytes": lambda cfg, t, b: t * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * b,
            "check_repeat_kv": lambda k, g: k.repeat_interleave(g, dim=1),
            "check_gqa_decode": gqa_decode,
            "check_online_softmax": online,
            "check_merge_splits": merge,
            "check_slot_lookup": lambda t, bs, p: t[p // bs] * bs + p % bs,
            "check_blocks_needed": lambda n, k, bs: -(-(n + k) // bs) - -(-n // bs)}


def test_every_exercise_passes_its_answer_and_fails_a_stub(capsys):
    import minillm.exercises as ex

    answers = _answers()
    assert set(answers) | {"check_top_p", "check_min_p"} == {n for n in ex.__all__ if n.startswith("check_")}
    for name, answer in answers.items():
        assert getattr(ex, name)(answer), name

        def stub(*args):
            raise NotImplementedError
        assert not getattr(ex, name)(stub), name
        assert "not written yet" in capsys.readouterr().out.splitlines()[-1]
