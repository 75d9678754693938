"""Choosing the next token from the logits.

    logits (vocab,) -> penalties and bias -> / temperature -> keep top-k -> keep top-p mass
                    -> keep >= min-p * max -> softmax -> draw

Each step is a pure function: logits in, logits out, with the removed tokens set to -inf.
Temperature 0 means greedy: the argmax (of the penalized logits), no randomness at all.

The penalties look back at what was already written, so a model that loops (greedy decoding
repeats itself, notebook 02) is pushed off its loop:

    presence / frequency (OpenAI):  logit[j] -= presence * (c[j] > 0) + frequency * c[j]
                                    c[j]: how often token j was generated so far
    repetition (CTRL, transformers): a token already in the prompt or output has a positive logit
                                    divided by the penalty, a negative one multiplied by it
    logit_bias (OpenAI):            logit[j] += bias[j]  (-100 bans j, +100 all but forces it)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class ParamError(ValueError):
    """A sampling parameter out of its range: the message says what to fix, `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0           # keep the smallest set whose probability reaches p
    min_p: float = 0.0           # keep tokens at least min_p times as likely as the best one
    max_tokens: int = 128        # new tokens at most
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop when the text contains one of these
    seed: int | None = None      # same seed, same samples
    ignore_eos: bool = False     # keep going past end-of-text tokens (benchmarks: fixed-length outputs)
    logprobs: int | None = None  # engine: report each token's log-probability and this many best alternatives
    prompt_logprobs: int | None = None  # engine: the same for every prompt token (scoring a text)
    presence_penalty: float = 0.0        # in [-2, 2]: subtracted once from each token already generated
    frequency_penalty: float = 0.0       # in [-2, 2]: subtracted per time a token was generated
    repetition_penalty: float = 1.0      # > 0; 1 is off: > 1 discourages every token seen (prompt and output)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict is accepted
    grammar: str | None = None           # engine: the output follows this grammar (structured.py builds one)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        except (TypeError, ValueError):
            raise ParamError("logit_bias", f"logit_bias must be a map of token ids to numbers; got {self.logit_bias!r}") from None
        checks = [
            ("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 means greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 turns it off)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 turns it off)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1] (0 turns it off)"),
            ("max_tokens", self.max_tokens, isinstance(self.max_tokens, int) and self.max_tokens >= 1
             or self.max_tokens == 0 and self.prompt_logprobs is not None,
             "an integer >= 1 (0 only to score a prompt, with prompt_logprobs)"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "in [-2, 2] (0 turns it off)"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2,
             "in [-2, 2] (0 turns it off)"),
            ("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 10,
             "in (0, 10] (1 turns it off)"),
            ("logit_bias", self.logit_bias, all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "token ids >= 0 with biases in [-100, 100]"),
            ("seed", self.seed, self.seed is None or isinstance(self.seed, int) and -2**63 <= self.seed < 2**64,
             "an integer in [-2**63, 2**64 - 1] (what a random generator's seed holds)"),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                checks.append((name, value, isinstance(value, int) and 0 <= value <= 20,
                               "an integer in [0, 20] (or None for no log-probabilities)"))
        for name, value, ok, allowed in checks:
            if not ok or value != value:  # value != value catches NaN
                raise ParamError(name, f"{name} must be {allowed}; got {value!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.ignore_eos):
            raise ParamError("grammar", "grammar must be a grammar string (minillm.structured builds them), and a "
                                        "grammar ends its answer with an end token: it cannot be used with ignore_eos")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError("stop", f"stop must be a list of non-empty strings; got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (penalties or a bias): then each token
        depends on the ones before it, and is sampled one at a time."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def sequential(self) -> bool:
        """Whether each token's logits depend on the tokens just before it (penalties, bias, a grammar):
        then the engine samples it alone, with no drafts."""
        return self.penalized or self.grammar is not None


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """ParamError if params name a token the model does not have (logit_bias)."""
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:
        raise ParamError("logit_bias", f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def token_counts(token_ids: list[int], vocab: int, device=None) -> torch.Tensor:
    """(vocab,) how often each token occurs in token_ids (float, ready to scale)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab)[:vocab].float()


def presence_frequency_penalty(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                               frequency: float) -> torch.Tensor:
    """OpenAI's penalties: logits (..., V), counts (..., V) of each generated token ->
    logits - presence * (counts > 0) - frequency * counts."""
    return logits - presence * (counts > 0) - frequency * counts


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al., 2019) as transformers and vLLM apply it: where `seen` (..., V) is
    true, a positive logit is divided by the penalty and a negative one multiplied by it (both make the
    token less likely for a penalty > 1)."""
    if penalty == 1:
        return logits
    out = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return out.clamp(max=torch.finfo(out.dtype).max)     # a tiny penalty overflows a logit: the largest finite one


def add_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits (..., V) + the bias of each listed token."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    return logits.index_add(-1, ids, torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device))


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
             output_ids: list[int]) -> torch.Tensor:
    """logits (V,) of one sequence, after the prompt and the output so far, with its penalties and bias
    (unchanged when it has none)."""
    if not params.penalized:
        return logits
    V = logits.shape[-1]
    logits = logits.float()
    if params.repetition_penalty != 1:
        seen = token_counts(prompt_ids + output_ids, V, logits.device) > 0
        logits = repetition_penalty(logits, seen, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = token_counts(output_ids, V, logits.device)
        logits = presence_frequency_penalty(logits, counts, params.presence_penalty, params.frequency_penalty)
    return add_logit_bias(logits, params.logit_bias)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by T: T < 1 sharpens the distribution, T > 1 flattens it. The best logit is taken off first
    (softmax does not change): then no T overflows to inf, and a tiny T tends to greedy, as it should (a T
    below the dtype's smallest normal number is taken as that number, not rounded to 0)."""
    return (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits in each row (ties: lower token id first)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices     # (..., V)
    drop = order[..., k:]                                                        # (..., V - k)
    return logits.scatter(-1, drop, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p,
    including the token that crosses p (nucleus sampling)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs        # probability of the better tokens
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False                              # the best token is always kept (p below float32's 1e-45 included)
    drop = drop_sorted.scatter(-1, order, drop_sorted)       # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the best token's."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from (not defined for greedy)."""
    logits = apply_temperature(logits.float(), params.temperature)
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    logits = min_p_filter(logits, params.min_p)
    return torch.softmax(logits, dim=-1)


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: (B, vocab) -> token ids (B,). The draw happens where the generator lives, so a
    seed gives the same tokens whether the logits are on a CPU or a GPU."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, params)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(logits.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
