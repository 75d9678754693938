"""Model routing: answer with a cheap model, and escalate to the exact one when the answer looks unsure.

A cascade spends the exact model's time only on the requests that need it. What decides is a
confidence signal, read from the cheap answer's own token log-probabilities (no second model):

    "mean"      mean log-probability of the chosen tokens: the answer's average surprise
    "min"       the lowest mean over any `window` consecutive tokens: one unsure stretch is enough
    "entropy"   minus the mean entropy of the next-token distributions (estimated from the best
                alternatives the engine reports; the rest of the mass counted as one outcome)

Higher is surer for all three. An answer whose confidence is below the threshold is escalated: the
exact model answers again from scratch, and its answer is the one returned.

    confidence(logprobs, signal)       one answer's confidence
    RoutePolicy(cheap, exact, ...)     the server's model "auto": which two models, which signal, what threshold
    Router(cheap, exact, ...)          route(prompts, params): the cascade over two LLMs, offline

How well a signal separates agreeing answers, and what each threshold costs, is measured offline by the
course (`course/routing_costs.py`: auc, tradeoff).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

SIGNALS = ("mean", "min", "entropy")
TOP_LOGPROBS = 5                # alternatives asked of the cheap model, for the entropy estimate


def confidence(logprobs: list[tuple[float, list[tuple[int, float]]]], signal: str = "mean", window: int = 8) -> float:
    """logprobs: per answer token (its log-probability, [(id, log-probability) of the best alternatives]),
    as RequestOutput.logprobs gives them. An empty answer is fully confident (0.0)."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown confidence signal {signal!r}: choose one of {', '.join(SIGNALS)}")
    if not logprobs:
        return 0.0
    chosen = [lp for lp, _ in logprobs]
    if signal == "mean":
        return sum(chosen) / len(chosen)
    if signal == "min":
        w = min(window, len(chosen))
        return min(sum(chosen[i:i + w]) / w for i in range(len(chosen) - w + 1))
    return -sum(_entropy(top) for _, top in logprobs) / len(logprobs)


def _entropy(top: list[tuple[int, float]]) -> float:
    """Entropy (nats) of a next-token distribution known by its best alternatives: their terms, plus the
    remaining mass as one outcome (a lower bound of the true entropy)."""
    ps = [math.exp(lp) for _, lp in top]
    rest = max(0.0, 1.0 - sum(ps))
    return -sum(p * math.log(p) for p in ps if p > 0) - (rest * math.log(rest) if rest > 0 else 0.0)


@dataclass(frozen=True)
class RoutePolicy:
    """A server's routed model: requests naming `name` go to `cheap`, and to `exact` when the cheap
    answer's confidence (the least confident of its choices) is below `threshold`."""
    cheap: str
    exact: str
    threshold: float
    signal: str = "mean"
    name: str = "auto"
    window: int = 8

    def __post_init__(self):
        confidence([], self.signal)
        if not math.isfinite(self.threshold):
            raise ValueError(f"the routing threshold must be a finite number; got {self.threshold}")
        if self.cheap == self.exact:
            raise ValueError(f"routing needs two different models; got '{self.cheap}' twice")

    def confident(self, outputs) -> bool:
        """Whether the cheap model's finished outputs (one per choice) are sure enough to return."""
        return min(confidence(o.logprobs or [], self.signal, self.window) for o in outputs) >= self.threshold


@dataclass
class Routed:
    """One routed answer: the output returned, which model gave it, and the cheap answer's confidence."""
    output: object
    model: str
    confidence: float


class Router:
    def __init__(self, cheap, exact, threshold: float, signal: str = "mean", names=("cheap", "exact")):
        """cheap, exact: LLMs (engine/llm.py) with the same tokenizer. threshold: escalate below it."""
        confidence([], signal)                         # (checks the signal's name)
        self.cheap, self.exact, self.threshold, self.signal, self.names = cheap, exact, threshold, signal, names

    def route(self, prompts: list, params) -> list[Routed]:
        """Every prompt to the cheap model; those whose answer is unsure again to the exact one."""
        asked = dataclasses.replace(params, logprobs=max(params.logprobs or 0, TOP_LOGPROBS))
        first = self.cheap.generate(prompts, asked, use_tqdm=False)
        routed = [Routed(o, self.names[0], confidence(o.logprobs or [], self.signal)) for o in first]
        unsure = [i for i, r in enumerate(routed) if r.confidence < self.threshold]
        if unsure:
            again = self.exact.generate([prompts[i] for i in unsure], params, use_tqdm=False)
            for i, o in zip(unsure, again):
                routed[i].output, routed[i].model = o, self.names[1]
        return routed


