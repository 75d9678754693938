"""Adaptive speculation: each sequence chooses how many tokens to draft, 0 to k, at every step.

A pass over j + 1 tokens emits E(j) = (1 - a^(j+1)) / (1 - a) tokens on average when each draft is
accepted with probability a, and costs cost(j + 1) (a pass over j + 1 tokens, measured) plus j draft
steps. So the sequence asks for the j that maximizes

    E(j) / (cost(j + 1) + j * draft_cost)          in tokens per unit of time; j = 0 is plain decoding

with a estimated from its own recent drafts. On a CPU a 4-token pass costs about 1.5 plain steps, so
drafting pays only where a is high (the answer copies its input); elsewhere j = 0 wins and the sequence
decodes plainly. After a few plain steps it drafts again (a probe), so a sequence that starts copying is
noticed; a probe whose drafts mostly fail doubles the wait before the next one (up to MAX_WAIT plain
steps), and a step whose drafts mostly succeed sets it back. In a batch a probe makes every sequence's step dearer:
probing every few steps, the drafts of requests that never copy cost a busy engine more than the copying
ones gained. The costs are measured, not assumed: on some CPUs a pass over 2 or 3 tokens costs more than one
over 4 (the matrix library picks another kernel for so few rows), and the choice follows. Which j is chosen never changes what is emitted: each step's verification is exact
given the tokens before it, whatever the number of drafts.

    ctl = AdaptiveK(k=8, pass_cost={1: 1.0, 2: 1.08, 3: 1.15, ...})
    j = ctl.choose()                  # drafts to ask for now
    drafts = drafts[:ctl.keep(len(drafts))]     # the proposer may find fewer: verify them only if it pays
    ...                               # verify: `accepted` of the `drafted` kept
    ctl.update(drafted, accepted)

The serving engine decides for the whole step at once (`choose_batch`): which sequences draft, and how
many tokens, from their acceptance estimates and the step and draft times it has measured (`StepTimes`).
"""
from __future__ import annotations

import statistics
import time
import weakref

from .verify import expected_tokens_per_step

_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # model -> {(stage, T): seconds}

# A proposer given alone drafts adaptively, up to K_ADAPTIVE tokens a step; asked for fixed k, it drafts
# K_FIXED every step. Measured (benchmarks/speculative.py --adaptive, one stream, four task types): fixed
# k = 4 lost speed on every task where a pass over 5 tokens falls off the native backend's C loop, and
# adaptive k <= 8 came out no worse than fixed k on any task with PyTorch's layers, where k <= 4 did.
K_ADAPTIVE, K_FIXED = 8, 4
MAX_WAIT = 32            # the most plain steps between two probes of a sequence whose drafts keep failing


def speculation_settings(speculative, adaptive: bool | None, k: int | None) -> tuple[bool, int | None]:
    """(adaptive, k) for `speculative` as asked: adaptive unless adaptive is False; k as given, else
    K_ADAPTIVE or K_FIXED. No proposer: (False, None), and ValueError where adaptive is True."""
    if speculative is None:
        if adaptive:
            raise ValueError("adaptive_speculation chooses how many tokens a speculative proposer drafts: give "
                             "speculative= too")
        return False, None
    adaptive = adaptive is not False
    return adaptive, k if k is not None else K_ADAPTIVE if adaptive else K_FIXED


class AdaptiveK:
    def __init__(self, k: int, pass_cost: dict[int, float], draft_cost: float = 0.0, prior: float = 0.5,
                 memory: float = 0.7, probe_every: int = 4, hope: float = 0.9):
        """k: the most drafts a step may ask for. pass_cost: {T: time of a pass over T tokens}, for T = 1..k+1,
        in any unit (seconds, or relative to T = 1). draft_cost: one draft step, in the same unit (0 for a
        lookup such as n-gram). prior: the acceptance assumed before any draft. memory: the weight an
        earlier estimate keeps at each update (0.7: the last few steps count). probe_every: plain steps
        between probes; hope: the acceptance a probe is sized for (a proposer that would not pay even at
        this acceptance is never probed)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1; got {k!r}")
        missing = [T for T in range(1, k + 2) if T not in pass_cost]
        if missing:
            raise ValueError(f"pass_cost needs the cost of a pass over 1..{k + 1} tokens; missing {missing}")
        self.k, self.draft_cost, self.memory, self.probe_every = k, draft_cost, memory, probe_every
        self.cost = {T: float(pass_cost[T]) for T in range(1, k + 2)}
        self.prior, self.hope = prior, hope
        self.accepted, self.tried = prior, 1.0         # discounted counts: alpha = accepted / tried
        self.wait = probe_every                         # plain steps before the next probe
        self.plain_steps, self.probing, self.batch = probe_every, False, 1   # the first step probes

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    @property
    def probe_due(self) -> bool:
        """Whether the sequence has decoded plainly long enough to draft once more at the hoped-for alpha."""
        return self.plain_steps >= self.wait

    def rate(self, j: int, alpha: float | None = None) -> float:
        """Expected tokens per unit of time when drafting j tokens (at the current alpha, or this one). In a
        batch of B sequences the step's other B - 1 tokens wait for the drafts too: (B - 1 + E(j)) / B."""
        a = self.alpha if alpha is None else alpha
        B = self.batch
        return (B - 1 + expected_tokens_per_step(a, j)) / B / (self.cost[j + 1] + j * self.draft_cost)

    def choose(self, room: int | None = None, pass_cost: dict[int, float] | None = None, batch: int = 1) -> int:
        """The number of drafts to ask for now: the best rate among 0..min(k, room); after probe_every plain
        steps in a row, the best j >= 1 at the hoped-for acceptance (a probe: is the sequence copying now?).
        The engine passes this step's costs (a step with j more tokens / the step without them) and the
        number of sequences that share it."""
        if pass_cost is not None:
            self.cost = pass_cost
        self.batch = batch
        top = self.k if room is None else max(0, min(self.k, room))
        best = max(range(top + 1), key=self.rate)
        self.probing = False
        if best == 0 and top > 0:
            self.plain_steps += 1
            probe = max(range(1, top + 1), key=lambda j: self.rate(j, self.hope))
            if self.probe_due and self.rate(probe, self.hope) > self.rate(0):
                self.plain_steps, self.probing = 0, True          # (never, where even `hope` would not pay)
                return probe
        return best

    def keep(self, drafted: int) -> int:
        """How many of `drafted` drafts to verify when the proposer found fewer than asked: the best prefix
        (a pass over 2 or 3 tokens can cost more per token than over 4); all of them for a probe."""
        if self.probing or drafted == 0:
            return drafted
        return max(range(drafted + 1), key=self.rate)

    def trim(self, drafts: list[int], probs, asked: int):
        """(drafts, probs) cut to what is worth verifying when the proposer found fewer than `asked`."""
        if len(drafts) >= asked:
            return drafts, probs
        n = self.keep(len(drafts))
        return drafts[:n], None if probs is None or not n else probs[:n]

    def update(self, drafted: int, accepted: int) -> None:
        """After a verification: of `drafted` drafts, the first `accepted` were kept. Each draft up to the
        first rejection was a trial of alpha (a draft after a rejection was never judged). A probe with fewer
        than half accepted doubles the wait before the next probe (up to MAX_WAIT); any step with half or
        more sets it back."""
        if drafted <= 0:
            return
        self.plain_steps = 0
        if 2 * accepted >= drafted:
            self.wait = self.probe_every
        elif self.probing:
            self.wait = min(2 * self.wait, MAX_WAIT)
        self.probing = False
        trials = min(accepted + 1, drafted)
        self.accepted = self.memory * self.accepted + accepted
        self.tried = self.memory * self.tried + trials


def measure_pass_costs(runner, max_tokens: int, repeats: int = 3) -> dict[int, float]:
    """{T: a pass over T tokens / a pass over 1}, T = 1..max_tokens, timed on `runner` where it stands (its
    cache is rolled back after each pass); rounds alternate over T, so a slow moment hits every T alike.
    Measured once per model and stage in a process, then reused."""
    key = (getattr(runner, "name", type(runner).__name__), runner.length // 256)
    known = _MEASURED.setdefault(runner.model, {})
    if all((key, T) in known for T in range(1, max_tokens + 1)):
        return {T: known[key, T] / known[key, 1] for T in range(1, max_tokens + 1)}
    start = runner.length
    times: dict[int, list[float]] = {T: [] for T in range(1, max_tokens + 1)}
    for r in range(repeats + 1):                     # the first round warms up
        for T in times:
            t0 = time.perf_counter()
            runner.extend([0] * T)
            runner.truncate(start)
            if r:
                times[T].append(time.perf_counter() - t0)
    for T, ts in times.items():
        known[key, T] = statistics.median(ts)
    return {T: known[key, T] / known[key, 1] for T in times}


class StepTimes:
    """A serving engine's measured times: a step over n tokens, and one draft pass over m sequences.

    Each size seen keeps its own running estimate: on a CPU step time is not a straight line in tokens (a
    step of 10 tokens can cost more than one of 12, as the matrix library switches kernels). A size not
    seen yet is read off a line fitted to all steps, recent ones weighing more; until steps of two sizes
    have been seen, extra tokens are taken as free (as on a GPU at small batch), so drafts get tried and
    the table fills in."""

    def __init__(self, memory: float = 0.8):
        self.memory = memory
        self.steps: dict[int, float] = {}        # tokens -> seconds
        self.drafts: dict[int, float] = {}       # sequences -> seconds of one draft pass
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def _ema(self, table: dict, key: int, seconds: float) -> None:
        table[key] = seconds if key not in table else self.memory * table[key] + (1 - self.memory) * seconds

    def observe(self, tokens: int, seconds: float) -> None:
        self._ema(self.steps, tokens, seconds)
        m = 0.98
        self.n, self.sx, self.sy = m * self.n + 1, m * self.sx + tokens, m * self.sy + seconds
        self.sxx, self.sxy = m * self.sxx + tokens * tokens, m * self.sxy + tokens * seconds

    def observe_draft(self, sequences: int, seconds: float) -> None:
        self._ema(self.drafts, sequences, seconds)

    def line(self) -> tuple[float, float]:
        """(a, b): seconds = a + b * tokens; b = 0 until the fit has tokens of different counts."""
        if self.n == 0:
            return 1.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        b = max((self.sxy / self.n - mx * my) / var, 0.0) if var > 1e-9 else 0.0
        return max(my - b * mx, 1e-6), b

    def step(self, tokens: int) -> float:
        if tokens in self.steps:
            return self.steps[tokens]
        a, b = self.line()
        return a + b * tokens

    def draft(self, sequences: int, relative_cost: float) -> float:
        """One draft pass over this many sequences: measured, or until then relative_cost (the proposer's
        draft step / a decode step) times a step of that many tokens. 0 for a lookup."""
        if relative_cost == 0:
            return 0.0
        return self.drafts.get(sequences, relative_cost * self.step(sequences))


def choose_batch(alphas: list[float], rooms: list[int], base_tokens: int, batch: int, k: int,
                 times: StepTimes, draft_cost: float) -> list[int]:
    """Drafts per sequence for one engine step: the m sequences most likely to be accepted draft j tokens
    each (at most their room), the others none, with (m, j) the pair that maximizes the step's expected
    tokens per second

        (batch + sum over the m of (E(a_i, j) - 1)) / (step(base_tokens + their drafts) + j * draft(m))

    where batch sequences emit a token anyway and the step without drafts computes base_tokens. m = 0 is
    plain decoding for all. A busy step's tokens are not free, so drafts pay only where they are likely."""
    order = sorted(range(len(alphas)), key=lambda i: -alphas[i])
    best, best_rate = (0, 0), batch / times.step(base_tokens)
    for j in range(1, k + 1):
        gain, extra = 0.0, 0
        for m, i in enumerate(order, start=1):
            d = min(j, rooms[i])
            gain += expected_tokens_per_step(alphas[i], d) - 1
            extra += d
            rate = (batch + gain) / (times.step(base_tokens + extra) + j * times.draft(m, draft_cost))
            if rate > best_rate:
                best, best_rate = (m, j), rate
    m, j = best
    chosen = [0] * len(alphas)
    for i in order[:m]:
        chosen[i] = min(j, rooms[i])
    return chosen
