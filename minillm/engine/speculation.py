"""Speculative decoding in the engine: drafts for every decoding request, verified in the step's pass.

    schedule  a decoding request gets room for 1 + k tokens (scheduler.py: drafts count against the budget)
    propose   drafts for each such request: n-gram lookup in its own tokens (any proposer that needs
              nothing but the tokens works the same way); a layer-skipping draft run for all at once (k
              passes of one token per request through the first N layers, writing K/V into the pool: the
              target's layers < N would compute the same); or a draft model with a block pool of its own
              (draft.py: the model's quantized copy, `draft:q4`), also for all at once. `ngram+draft:q4`
              looks up first and runs the draft model only for the requests the lookup found nothing for.
    execute   one forward pass over everything scheduled; logits at the sampled token and every draft
    verify    per request, the exact rule (speculative/verify.py): accepted drafts + one more token
    roll back num_computed_tokens covers the sampled token and the accepted drafts; blocks past it
              return to the pool; only blocks full of accepted tokens enter the prefix cache

Each request drafts as many tokens as its room allows, so one request near its max_tokens or a tight
budget never holds the others back.
"""
from __future__ import annotations

import torch

from ..speculative import CascadeProposer, DraftModelProposer, LayerSkipProposer, make_proposer, target_probs
import time

from ..speculative.adaptive import AdaptiveK, StepTimes, choose_batch
from ..speculative.proposers import pick_draft
from ..speculative import verify as verify_rule
from ..speculative import verify_greedy
from .draft import DraftModelCache
from .request import Request
from .scheduler import ScheduledBatch


class Speculator:
    greedy_rule = staticmethod(verify_greedy)     # (drafts, target argmax) -> tokens; notebook 10 plugs in its own

    def __init__(self, proposer, runner, num_speculative_tokens: int, adaptive: bool = False):
        """adaptive: each step, the requests most likely to be accepted draft j tokens and the rest none, with
        j and how many chosen so that the step's expected tokens per second is highest, from each request's
        own acceptance and the step and draft times measured so far (speculative/adaptive.py)."""
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1; got {num_speculative_tokens!r}")
        self.proposer = make_proposer(proposer)
        cascade = isinstance(self.proposer, CascadeProposer)
        self.lookup = self.proposer.first if cascade else None           # tried first, for every request
        drafter = self.proposer.second if cascade else self.proposer
        self.draft = None                                                  # a draft model's own cache
        if isinstance(drafter, DraftModelProposer):
            kv = runner.kv
            self.draft = DraftModelCache(drafter.draft_model(runner.model), runner, kv.pool.num_blocks,
                                         kv.block_size, kv.prefix_caching)
        if isinstance(self.proposer, LayerSkipProposer):
            self.proposer.check(runner.model)
        self.runner, self.k = runner, num_speculative_tokens
        self.times = StepTimes() if adaptive else None
        self._draft_cost = self.proposer.relative_cost(runner.model)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0   # vLLM's counters

    # ------------------------------------------------------------ propose
    def propose(self, batch: ScheduledBatch) -> None:
        """Fill req.spec_token_ids (and spec_probs) of every request with room for drafts; a request
        that gets fewer drafts than its room computes fewer tokens."""
        todo = [(i, r, s) for i, (r, s) in enumerate(zip(batch.requests, batch.num_spec_slots)) if s]
        if self.times is not None and todo:
            todo = self._adapt(batch, todo)
        if not todo:
            return
        t0, passes = time.perf_counter(), max(s for _, _, s in todo)
        if isinstance(self.proposer, LayerSkipProposer):
            self._draft_layers([r for _, r, _ in todo], [s for _, _, s in todo])
        elif self.draft is not None:
            rest = todo
            if self.lookup is not None:                                # n-gram first; the model for the rest
                rest = [t for t in todo if not self._lookup(self.lookup, *t[1:])]
            if rest:
                self.draft.propose([r for _, r, _ in rest], [s for _, _, s in rest])
        else:
            for _, req, s in todo:
                self._lookup(self.proposer, req, s)
        if self.times is not None and self.draft is not None:      # its passes (not a first prefill)
            for rows, seconds in self.draft.pass_times:
                self.times.observe_draft(rows, seconds)
        elif self.times is not None and self._draft_cost:
            self.times.observe_draft(len(todo), (time.perf_counter() - t0) / passes)
        for i, req, s in todo:
            batch.set_drafts(i, len(req.spec_token_ids))

    @staticmethod
    def _lookup(proposer, req: Request, s: int) -> bool:
        """Drafts from a proposer that needs only the tokens; whether it found any."""
        drafts, probs = proposer.propose(req.all_token_ids, s)
        req.spec_token_ids, req.spec_probs = list(drafts)[:s], probs
        return bool(req.spec_token_ids)

    def _adapt(self, batch: ScheduledBatch, todo: list) -> list:
        """This step's drafts per request (choose_batch); requests given none decode plainly (their slots
        are given back as plain one-token rows). A request that has decoded plainly for a while is weighed
        at the acceptance hoped for (a probe: is it copying now?)."""
        tokens = batch.total_tokens - sum(s for _, _, s in todo)        # the step without drafts
        alphas, due = [], []
        for _, req, _ in todo:
            if req.spec_control is None:
                req.spec_control = AdaptiveK(self.k, {T: 1.0 for T in range(1, self.k + 2)}, self._draft_cost)
            ctl = req.spec_control
            due.append(ctl.probe_due)
            alphas.append(ctl.hope if due[-1] else ctl.alpha)
        chosen = choose_batch(alphas, [s for _, _, s in todo], tokens, len(batch.requests), self.k, self.times,
                              self._draft_cost)
        drafting = []
        for (i, req, _), j, probe in zip(todo, chosen, due):
            batch.set_drafts(i, j)
            req.spec_token_ids, req.spec_probs = [], None
            req.spec_control.probing = bool(j) and probe              # (a failed probe waits longer)
            if j:
                drafting.append((i, req, j))
            else:
                req.spec_control.plain_steps += 1
        return drafting

    def observe(self, tokens: int, seconds: float) -> None:
        """A step's size and time (adaptive speculation's cost model learns from it)."""
        if self.times is not None:
            self.times.observe(tokens, seconds)

    @torch.inference_mode()
    def _draft_layers(self, reqs: list[Request], room: list[int]) -> None:
        """k passes through the first N layers, one token per request still drafting."""
        n_layers = self.proposer.n_layers
        last = [r.output_token_ids[-1] for r in reqs]                       # sampled, not yet computed
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for j in range(max(room)):
            active = [i for i, s in enumerate(room) if s > j]
            tokens = [drafts[i][-1] if j else last[i] for i in active]
            positions = [reqs[i].num_computed_tokens + j for i in active]
            logits = self.runner.draft_step([reqs[i] for i in active], tokens, positions, n_layers)  # (A, vocab)
            for row, i in enumerate(active):
                token, q = pick_draft(logits[row], reqs[i].params, reqs[i].generator)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
        for i, r in enumerate(reqs):
            r.spec_token_ids = drafts[i]
            r.spec_probs = torch.stack(probs[i]) if probs[i] else None

    # ------------------------------------------------------------ verify
    def verify(self, req: Request, logits: torch.Tensor) -> list[int]:
        """logits (1 + drafts, vocab) -> the tokens to emit (accepted drafts + one), counted."""
        drafts = req.spec_token_ids
        if req.params.greedy:
            new = self.greedy_rule(drafts, logits.argmax(dim=-1).tolist())
        else:
            new = verify_rule(drafts, req.spec_probs, target_probs(logits, req.params), req.generator)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(new) - 1
        if req.spec_control is not None:
            req.spec_control.update(len(drafts), len(new) - 1)
        return new                         # (the scheduler's update keeps the accepted drafts' K/V)
