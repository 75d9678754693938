"""Choosing the next token from the logits.

    logits (vocab,) -> / temperature -> keep top-k -> keep top-p mass -> keep >= min-p * max -> softmax -> draw

Each filter is a pure function: logits in, logits out, with the removed tokens
set to -inf. Temperature 0 means greedy: the argmax, no randomness at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        checks = [
            ("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 means greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 turns it off)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 turns it off)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1] (0 turns it off)"),
            ("max_tokens", self.max_tokens, isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
        ]
        if self.logprobs is not None:
            checks.append(("logprobs", self.logprobs, isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
                           "an integer in [0, 20] (or None for no log-probabilities)"))
        for name, value, ok, allowed in checks:
            if not ok or value != value:  # value != value catches NaN
                raise ValueError(f"{name} must be {allowed}; got {value!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings; got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by T: T < 1 sharpens the distribution, T > 1 flattens it."""
    return logits / temperature


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
    drop_sorted = mass_before >= p                           # the best token has 0 before it: always kept
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
