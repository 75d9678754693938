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
