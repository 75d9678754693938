"""The exercises that build pieces of the engine: the notebooks' own answers pass their checks, and answers
that break one rule of the engine fail them. No model: plain data and tiny tensors."""
import json
import random
from pathlib import Path

import matplotlib
import pytest
import torch

from minillm.course.exercises.engine import _engine_schedule, _random_state, check_schedule
from minillm.course.exercises.speculative import check_accept_draft
from minillm.course.spec_timeline import Pass, draw_passes, passes_from, pick_window

ROOT = Path(__file__).resolve().parents[1]


def answer_cell(notebook: str, check: str) -> str:
    """The source of the notebook's collapsed answer that calls `check`."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and c["metadata"].get("jupyter", {}).get("source_hidden")
             and f"passed = {check}(" in "".join(c["source"])]
    assert len(found) == 1, f"{notebook}: one collapsed answer calling {check}"
    return "".join(found[0]["source"])


def run_answer(notebook: str, check: str, namespace: dict) -> bool:
    exec(answer_cell(notebook, check), namespace)
    return namespace["passed"]


# ------------------------------------------------------------------ notebook 07: one step of the scheduler
def blocks(tokens, block_size):
    return -(-tokens // block_size)


def schedule(running, waiting, budget, max_seqs, free_blocks, block_size, *, preempt="newest", admit_after=False,
             overtake=False, seq_cap=True, chunk_waiting=True):
    """The rules, with switches that each break one of them."""
    running, scheduled, preempted = list(running), [], []
    i = 0
    while i < len(running) and budget > 0:
        name, computed, left = running[i]
        n = min(left, budget)
        need = blocks(computed + n, block_size) - blocks(computed, block_size)
        if preempt is None and need > free_blocks:            # skip instead of preempting
            i += 1
            continue
        while need > free_blocks and i < len(running):
            victim = running.pop() if preempt == "newest" else running.pop(i + 1 if i + 1 < len(running) else i)
            free_blocks += blocks(victim[1], block_size)
            preempted.append(victim[0])
        if i == len(running) or running[i][0] != name:
            break
        scheduled.append((name, n))
        budget, free_blocks, i = budget - n, free_blocks - need, i + 1
    seqs = len(running)
    for name, left in ([] if preempted and not admit_after else waiting):
        n = min(left, budget) if chunk_waiting else (left if left <= budget else 0)
        if n == 0 or (seq_cap and seqs == max_seqs) or blocks(n, block_size) > free_blocks:
            if overtake and n:
                continue
            break
        scheduled.append((name, n))
        budget, free_blocks, seqs = budget - n, free_blocks - blocks(n, block_size), seqs + 1
    return scheduled, preempted


def test_the_rules_are_the_engine_schedulers_on_random_states():
    rng = random.Random(0)
    for _ in range(500):
        state = _random_state(rng)
        assert schedule(*state) == _engine_schedule(*state), state


def test_the_notebooks_schedule_answer_passes(model, tokenizer, capsys):
    from minillm.course.exercises import check_schedule_in_engine
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4, 5,", "Water boils at")]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    naive = [generate(model, tokenizer, p, params, stage="naive").token_ids for p in prompts]
    namespace = {"check_schedule": check_schedule, "check_schedule_in_engine": check_schedule_in_engine,
                 "model": model, "tok": tokenizer, "prompts": prompts, "params": params, "naive": naive}
    assert run_answer("07_continuous_batching.ipynb", "check_schedule", namespace)   # then it drives an engine
    out = capsys.readouterr().out
    assert "9 of 9 checks pass" in out and "✓ your scheduler drove the engine" in out


@pytest.mark.parametrize("broken", [
    {"preempt": None},              # a request that does not fit is skipped, nobody preempted
    {"preempt": "oldest"},          # the request after it goes, not the newest
    {"admit_after": True},          # admits from the queue in a step that preempted
    {"overtake": True},             # a smaller request behind a head that does not fit goes first
    {"seq_cap": False},             # ignores max_seqs
    {"chunk_waiting": False},       # a waiting prompt goes whole or waits
], ids=lambda b: next(iter(b)))
def test_a_schedule_that_breaks_one_rule_fails(broken, capsys):
    assert not check_schedule(lambda *state: schedule(*state, **broken))
    assert "the engine's scheduler gives" in capsys.readouterr().out


def test_an_unwritten_schedule_says_so(capsys):
    def stub(*state):
        raise NotImplementedError
    assert not check_schedule(stub)
    assert "not written yet" in capsys.readouterr().out


# ------------------------------------------------------------------ notebook 10: accept or replace a draft
def residual(p, q):
    r = (p - q).clamp_min(0)
    return r / r.sum()


def draw(dist, generator):
    return int(torch.multinomial(dist, 1, generator=generator))


def test_the_notebooks_accept_answer_passes(capsys):
    namespace = {"torch": torch, "check_accept_draft": check_accept_draft}
    assert run_answer("10_speculative_decoding.ipynb", "check_accept_draft", namespace)
    assert "5 of 5 checks pass" in capsys.readouterr().out


def test_a_right_answer_with_its_own_random_stream_passes(capsys):
    """The check's tolerances hold for any right answer, not only for the draws of torch's generator."""
    rng = random.Random(1)

    def own_stream(p, q, x, u, generator):
        if u * q[x] < p[x]:
            return x
        return rng.choices(range(len(p)), weights=residual(p, q).tolist())[0]
    assert check_accept_draft(own_stream)
    capsys.readouterr()


BROKEN_ACCEPTS = {
    "accepts with probability p(x)": lambda p, q, x, u, g: x if u < p[x] else draw(residual(p, q), g),
    "accepts with probability q(x)/p(x)": lambda p, q, x, u, g: x if u * p[x] < q[x] else draw(residual(p, q), g),
    "accepts when u is above the ratio": lambda p, q, x, u, g: x if u * q[x] >= p[x] else draw(residual(p, q), g),
    "replaces from p": lambda p, q, x, u, g: x if u * q[x] < p[x] else draw(p, g),
    "replaces from p without x": lambda p, q, x, u, g: x if u * q[x] < p[x] else draw(p * (torch.arange(len(p)) != x), g),
    "replaces with the residual's argmax": lambda p, q, x, u, g: x if u * q[x] < p[x] else int(residual(p, q).argmax()),
}


@pytest.mark.parametrize("name", BROKEN_ACCEPTS)
def test_an_accept_step_that_breaks_the_rule_fails(name, capsys):
    assert not check_accept_draft(BROKEN_ACCEPTS[name])
    assert "✗" in capsys.readouterr().out


def test_an_unwritten_accept_step_says_so(capsys):
    def stub(p, q, x, u, generator):
        raise NotImplementedError
    assert not check_accept_draft(stub)
    assert "not written yet" in capsys.readouterr().out


# ------------------------------------------------------------------ notebook 10: the picture of the passes
def test_passes_follow_from_the_answer_and_the_drafts():
    answer = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    guesses = {1: [1, 2, 3], 5: [5, 0, 7], 7: []}      # all kept + bonus; one kept then a correction; no drafts
    passes = passes_from(answer, guesses)
    assert passes == [Pass(1, [1, 2, 3], 3, [1, 2, 3, 4]), Pass(5, [5, 0, 7], 1, [5, 6]), Pass(7, [], 0, [7]),
                      Pass(8, [], 0, [8])]
    assert [p.rejected for p in passes] == [False, True, False, False]
    assert sum(len(p.emitted) for p in passes) == len(answer) - 1
    assert pick_window(passes, 2) == 0


def test_the_picture_draws_every_kind_of_pass():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    class Tok:
        def decode(self, ids):
            return " ".join(f"t{i}" for i in ids)
    passes = passes_from([9, 1, 2, 3, 4, 5, 6, 7, 8], {1: [1, 2, 3], 5: [5, 0, 7], 7: []})
    ax = draw_passes(passes, Tok(), count=3)
    assert len(ax.patches) == 3 + 4 + 3 + 2 + 1       # drafts and emitted tokens of the three passes shown
    plt.close("all")
