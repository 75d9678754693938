"""Speculative decoding, pass by pass: what the proposer drafted, what the target kept, what it added.

    record_passes(model, tok, prompt_ids, params, speculative, k)   a real run, one `Pass` per target pass
    passes_from(answer, guesses)                                     the passes, from the answer and the drafts
    draw_passes(passes, tok, ax)                                     the timeline of a few of them

The run is `generate(..., speculative=...)` itself, with the proposer wrapped so that it writes down every
guess. What each pass kept follows from the answer: the drafts up to the first that differs from it, then
one token of the target's own (a rejected draft is never its own replacement: the residual max(0, p − q)
is zero there).
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt

from ..generate import generate
from ..speculative.proposers import Proposer, make_proposer

COLOURS = {"accepted": "#a1d99b", "rejected": "#fc9272", "unjudged": "#eeeeee",
           "correction": "#fdae6b", "bonus": "#6baed6", "plain": "#bcbddc"}


@dataclass(slots=True)
class Pass:
    start: int              # answer tokens before this pass
    drafts: list[int]       # the proposer's guesses (empty: nothing found, a plain decode step)
    accepted: int           # how many of them the target kept
    emitted: list[int]      # the kept drafts, then the target's own token

    @property
    def rejected(self) -> bool:
        return self.accepted < len(self.drafts)


class _Recording(Proposer):
    """A proposer that writes down what another one guesses, and where."""

    def __init__(self, inner: Proposer):
        self.inner, self.name, self.calls = inner, inner.name, []

    def start(self, runner, params, generator) -> None:
        self.inner.start(runner, params, generator)

    def propose(self, token_ids, k):
        drafts, q = self.inner.propose(token_ids, k)
        self.calls.append((len(token_ids), [int(d) for d in drafts]))
        return drafts, q

    def relative_cost(self, target) -> float:
        return self.inner.relative_cost(target)


def record_passes(model, tok, prompt_ids: list[int], params, speculative="ngram", k: int = 4) -> list[Pass]:
    """Generate with `speculative` drafting k tokens every pass (the kv stage, one stream, fixed k); every
    target pass."""
    rec = _Recording(make_proposer(speculative))
    out = generate(model, tok, prompt_ids, params, stage="kv", speculative=rec, num_speculative_tokens=k,
                   adaptive_speculation=False).token_ids
    return passes_from(out, {length - len(prompt_ids): drafts for length, drafts in rec.calls})


def passes_from(answer: list[int], guesses: dict[int, list[int]]) -> list[Pass]:
    """The passes of a run that produced `answer`, given the drafts proposed after each answer length."""
    passes, pos = [], 1                         # the first token comes from the prompt's pass
    while pos < len(answer):
        drafts = guesses.get(pos, [])
        kept = 0
        while kept < len(drafts) and pos + kept < len(answer) and drafts[kept] == answer[pos + kept]:
            kept += 1
        passes.append(Pass(pos, drafts, kept, answer[pos:pos + kept + 1]))
        pos += len(passes[-1].emitted)
    return passes


def pick_window(passes: list[Pass], count: int = 5) -> int:
    """Where `count` passes in a row show both a rejection and a bonus token, all of them drafting if
    possible (failing both, the first pass)."""
    for all_drafted in (True, False):
        for i in range(len(passes) - count + 1):
            w = passes[i:i + count]
            if (any(p.rejected for p in w) and any(p.drafts and not p.rejected for p in w)
                    and (all(p.drafts for p in w) or not all_drafted)):
                return i
    return 0


def _label(tok, token: int) -> str:
    text = tok.decode([token]).replace("\n", "⏎").replace(" ", "·")
    return text if len(text) <= 7 else text[:6] + "…"


def draw_passes(passes: list[Pass], tok, ax=None, first: int | None = None, count: int = 5):
    """Each pass two rows: above, the k drafts (kept, the first rejected, never judged after it); below,
    what the one target pass emitted (the kept drafts, then a correction or a bonus token). A pass starts
    where the one before it ended, so the staircase's steps are the tokens per pass."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.9 * count + 1.2))
    first = pick_window(passes, count) if first is None else first
    shown = passes[first:first + count]
    x0 = shown[0].start

    def box(x, y, colour, text, strike=False):
        ax.add_patch(plt.Rectangle((x - x0, y), 0.96, 0.8, facecolor=colour, edgecolor="grey", lw=0.5))
        ax.text(x - x0 + 0.48, y + 0.4, text, ha="center", va="center", fontsize=8, color="black")
        if strike:      # a light line, so the token under it stays legible
            ax.plot([x - x0 + 0.1, x - x0 + 0.86], [y + 0.4, y + 0.4], color="darkred", lw=0.8, alpha=0.45)

    ticks, labels = [], []
    for i, p in enumerate(shown):
        top, bottom = -2.2 * i, -2.2 * i - 0.9
        if not p.drafts:
            ax.text(p.start - x0 + 0.1, top + 0.4, "nothing drafted: a plain decode step", va="center", fontsize=8,
                    color="dimgrey")
        for j, d in enumerate(p.drafts):
            state = "accepted" if j < p.accepted else "rejected" if j == p.accepted else "unjudged"
            box(p.start + j, top, COLOURS[state], _label(tok, d), strike=state != "accepted")
        for j, t in enumerate(p.emitted):
            own = "plain" if not p.drafts else "correction" if p.rejected else "bonus"
            box(p.start + j, bottom, COLOURS["accepted" if j < p.accepted else own], _label(tok, t))
        end = p.start + max(len(p.drafts), len(p.emitted))
        ax.text(end - x0 + 0.3, bottom + 0.4, f"+{len(p.emitted)} token{'s' * (len(p.emitted) > 1)}",
                va="center", fontsize=8)
        ticks += [top + 0.4, bottom + 0.4]
        labels += [f"pass {first + i + 1}: the proposer drafts", "one target pass emits"]
    width = max(p.start + max(len(p.drafts), len(p.emitted)) for p in shown) - x0 + 3
    ax.set(xlim=(-0.2, width), ylim=(-2.2 * (len(shown) - 1) - 1.1, 1.0), yticks=ticks,
           xlabel=f"position in the answer (from token {x0})")
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks([])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=COLOURS[c], edgecolor="grey") for c in COLOURS],
              labels=["draft accepted", "draft rejected", "drafted after a rejection: never judged",
                      "the target's correction", "the target's next token after all drafts (bonus)",
                      "nothing drafted: a plain decode step's token"],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False)
    return ax
