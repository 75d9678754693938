"""Proposers: cheap guesses of the next k tokens, for the target model to verify in one pass.

    propose(token_ids, k) -> (draft ids (at most k), draft probabilities (k', vocab) or None)

`token_ids` is the whole sequence so far (prompt + output); its last token has been sampled but
not yet run through the target. None for the probabilities means a deterministic guess (q one-hot).
A proposer may return fewer than k tokens, or none: then the step is a plain decode step.

- `NgramProposer`: prompt lookup. Find the most recent earlier place where the last n tokens
  occurred and propose what followed them there. No model, no cost: it pays off when the answer
  copies from the prompt (summaries, edits of given code, extraction into JSON).
- `LayerSkipProposer`: the target itself with only its first N layers (then its final norm and
  head): self-speculation. Its layers are the target's first N layers, so the K/V it needs are
  exactly the target's K/V of those layers: it drafts straight into the target's cache and rolls
  back, with no cache and no catch-up pass of its own.
- `DraftModelProposer`: any model with the same vocabulary, with its own KV cache. Before each
  proposal it rolls its cache back to what the target accepted and runs the tokens it has not seen.
  `draft:q4` (or int8, q4_file) is the target's own quantized copy: same tokenizer, same architecture,
  and on a CPU a fraction of the float32 model's bytes to read per token.
- `CascadeProposer`: n-gram lookup first (free), the draft model only when the lookup finds nothing.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from ..backends import apply_backend, backend_of, copy_modules, plain_model
from ..sampling import SamplingParams, filtered_probs


class Proposer:
    """The interface. `start` is called once per sequence, after the target's prefill."""

    name = "proposer"

    def start(self, runner, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.params, self.generator = params, generator

    def propose(self, token_ids: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        raise NotImplementedError

    def relative_cost(self, target) -> float:
        """One draft step's time over one of the target's decode steps (adaptive speculation weighs it);
        a lookup costs nothing."""
        return 0.0

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        return pick_draft(logits, self.params, self.generator)


def pick_draft(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
    """A draft token from logits (vocab,): the argmax for greedy, else drawn from the filtered
    distribution q (returned, as the rejection rule needs it)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = filtered_probs(logits, params)                                           # (vocab,)
    return int(torch.multinomial(q.to(generator.device), 1, generator=generator)), q


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"the n-gram sizes need 1 <= min_n <= max_n; got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.name = f"ngram[{min_n}-{max_n}]"

    def start(self, runner, params, generator) -> None:
        pass

    def propose(self, token_ids, k):
        return lookup_ngram(token_ids, k, self.min_n, self.max_n), None


def lookup_ngram(token_ids: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the last n tokens
    (n from max_n down to min_n; the longest match wins), or [] when there is none."""
    ids = np.asarray(token_ids, dtype=np.int64)
    L = len(ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)      # (L - n, n): starts 0 .. L-n-1
        hits = np.flatnonzero((windows == ids[L - n:]).all(axis=1))               # earlier occurrences
        if len(hits):
            start = int(hits[-1]) + n                                             # what followed the latest
            return ids[start:start + k].tolist()
    return []


class LayerSkipProposer(Proposer):
    def __init__(self, n_layers: int):
        if n_layers < 1:
            raise ValueError(f"the draft needs at least 1 layer; got {n_layers}")
        self.n_layers = n_layers
        self.name = f"layers:{n_layers}"

    def relative_cost(self, target) -> float:
        return self.n_layers / target.cfg.n_layers       # a decode step reads each layer's weights once

    def check(self, model) -> None:
        if self.n_layers >= model.cfg.n_layers:
            raise ValueError(f"a layer-skipping draft needs fewer layers than the model's "
                             f"{model.cfg.n_layers}; got {self.n_layers}")

    def start(self, runner, params, generator) -> None:
        super().start(runner, params, generator)
        if not hasattr(runner, "extend"):
            raise ValueError(f"the {runner.name} stage keeps no KV cache to draft into: use kv, flash or paged")
        self.check(runner.model)
        self.runner = runner

    def propose(self, token_ids, k):
        r = self.runner
        start = r.length
        assert start == len(token_ids) - 1, "the target's cache must hold every token but the last"
        drafts, qs, token = [], [], token_ids[-1]
        for _ in range(k):
            token, q = self._pick(r.extend([token], n_layers=self.n_layers)[-1])   # K/V of layers < N stored
            drafts.append(token)
            qs.append(q)
        r.truncate(start)                       # the target recomputes these positions when it verifies
        return drafts, None if self.params.greedy else torch.stack(qs)


class DraftModelProposer(Proposer):
    def __init__(self, model=None, stage: str = "kv", name: str = "draft-model", quant: str | None = None):
        """model: the draft; or quant ("int8", "q4", "q4_file"): the target's own quantized copy, made when
        the proposer first meets the target (`quantized_copy`)."""
        if (model is None) == (quant is None):
            raise ValueError("give the draft model, or quant= to draft with the model's quantized copy")
        if quant is not None:
            from ..quant import check_format

            check_format(quant)
            name = f"draft:{quant}"
        self.model, self.quant, self.stage, self.name = model, quant, stage, name

    def draft_model(self, target):
        return self.model if self.model is not None else quantized_copy(target, self.quant)

    def relative_cost(self, target) -> float:
        size = lambda m: sum(p.numel() * p.element_size() for p in m.state_dict().values())   # noqa: E731
        return size(self.draft_model(target)) / size(target)     # decoding is bound by the bytes it reads

    def start(self, runner, params, generator) -> None:
        from ..stages import make_runner

        super().start(runner, params, generator)
        self.draft = make_runner(self.draft_model(runner.model), self.stage, max_len=runner.max_len)
        self.seen: list[int] = []               # tokens whose K/V the draft's cache holds

    def propose(self, token_ids, k):
        if k == 0:
            return [], None
        d = self.draft
        same = 0                                # the cache is right up to the first token that differs
        for a, b in zip(self.seen, token_ids):
            if a != b:
                break
            same += 1
        same = min(same, len(token_ids) - 1)    # the last token always runs: its logits are needed
        if self.seen:
            d.truncate(same)
            logits = d.extend(token_ids[same:])[-1]
        else:                                    # first proposal: the draft's own prefill
            logits = d.prefill(token_ids)
        drafts, qs = [], []
        for i in range(k):
            token, q = self._pick(logits)
            drafts.append(token)
            qs.append(q)
            if i < k - 1:
                logits = d.extend([token])[-1]
        self.seen = list(token_ids) + drafts[:-1]
        return drafts, None if self.params.greedy else torch.stack(qs)


class CascadeProposer(Proposer):
    """Cheap first: `first`'s drafts when it has any (an n-gram lookup costs nothing), else `second`'s."""

    def __init__(self, first: Proposer, second: Proposer):
        self.first, self.second = first, second
        self.name = f"{first.name}+{second.name}"

    def relative_cost(self, target) -> float:
        return self.second.relative_cost(target)          # the dearer one prices a step

    def start(self, runner, params, generator) -> None:
        self.first.start(runner, params, generator)
        self.second.start(runner, params, generator)

    def propose(self, token_ids, k):
        drafts, q = self.first.propose(token_ids, k)
        return (drafts, q) if len(drafts) else self.second.propose(token_ids, k)


_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # model -> {format: its quantized copy}


def quantized_copy(model, quant: str):
    """The model with its weights quantized to `quant`, made once per model and format: a draft that reads a
    fraction of the model's bytes and agrees with it as far as its format allows (notebook 12 measures each). "int8", "q4" and "w8a8" (no SmoothQuant
    scales) quantize the model's own weights; "q4_file" takes the course model's GGUF blocks."""
    from ..quant import check_format, quantize_model

    check_format(quant)
    if model.quant:
        raise ValueError(f"the model is already quantized ({model.quant}): a quantized draft of it would not be cheaper")
    copies = _copies.setdefault(model, {})
    if quant not in copies:
        # A copy of the plain model's modules that shares its float parameters: quantizing replaces the copy's
        # linear layers and leaves the model's own, and no second float model is made. The draft then gets
        # the model's backend (a model prepared for native drafts with native kernels too).
        draft = quantize_model(copy_modules(plain_model(model)), quant, progress=False)
        copies[quant] = apply_backend(draft, backend_of(model)) if backend_of(model) != "torch" else draft
    return copies[quant]


def make_proposer(spec) -> Proposer:
    """'ngram', 'ngram:MIN-MAX', 'layers:N', 'draft:FORMAT' (the model's quantized copy: FORMAT is int8, q4
    or q4_file), 'ngram+draft:FORMAT' (n-gram first), or a Proposer (returned as is)."""
    if isinstance(spec, Proposer):
        return spec
    first, plus, rest = str(spec).partition("+")
    if plus:
        if not rest.startswith("draft:"):
            raise ValueError(f"bad speculative proposer {spec!r}: a cascade is 'ngram+draft:FORMAT'")
        return CascadeProposer(make_proposer(first), make_proposer(rest))
    kind, _, arg = str(spec).partition(":")
    try:
        if kind == "draft" and arg:
            return DraftModelProposer(quant=arg)
        if kind == "ngram":
            if not arg:
                return NgramProposer()
            lo, _, hi = arg.partition("-")
            return NgramProposer(int(lo), int(hi or lo))
        if kind == "layers" and arg:
            return LayerSkipProposer(int(arg))
    except ValueError as e:
        raise ValueError(f"bad speculative proposer {spec!r}: {e}") from None
    raise ValueError(f"unknown speculative proposer {spec!r}: use 'ngram', 'ngram:MIN-MAX', 'layers:N' "
                     f"(N = how many of the model's layers the draft runs), 'draft:q4' (or int8, q4_file: the "
                     f"model's quantized copy) or 'ngram+draft:q4'")
