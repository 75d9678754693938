"""The exercises that build pieces of the engine: the notebooks' own answers pass their checks, and answers
that break one rule of the engine fail them. No model: plain data and tiny tensors."""
import json
import random
from pathlib import Path

import pytest

from minillm.course.exercises.engine import _engine_schedule, _random_state, check_schedule

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


def test_the_notebooks_schedule_answer_passes(capsys):
    assert run_answer("07_continuous_batching.ipynb", "check_schedule", {"check_schedule": check_schedule})
    assert "9 of 9 checks pass" in capsys.readouterr().out


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
