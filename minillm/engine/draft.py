"""A draft model in the engine: its own paged KV cache, drafting for the whole batch at once.

The draft (the target's quantized copy, `draft:q4`, or any model with the same vocabulary) keeps its
K/V in a block pool of its own, through a KV-cache manager of its own, with one `DraftSequence` per
request. Each step, for the requests that have room for drafts:

    roll back   a request's draft cache keeps the longest prefix of the request's tokens it holds
                (drafts the target rejected are forgotten)
    catch up    one pass over every token each draft cache lacks: the whole prompt the first time (less
                what the draft pool's prefix cache holds), then the tokens accepted since; logits at
                each request's last token -> its first draft
    draft       s - 1 more passes of one token per request still drafting

Blocks full of a request's accepted tokens become findable in the draft pool's prefix cache, so a
shared prompt, a chat's next turn or a preempted request finds its draft K/V again. A request whose
draft cache cannot grow (the draft pool is full) decodes plainly that step. The scheduler frees a
request's draft cache with its target cache: when it ends, is aborted or is preempted. The draft pool
has as many blocks as the target's (the engine sizes it so): a draft model doubles the KV cache's memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..kv import BlockPool
from ..kv.manager import KVCacheManager
from ..kv.prefix_cache import PrefixCachingPool
from ..paged_forward import PagedForward, pack
from ..speculative.proposers import pick_draft


@dataclass
class DraftSequence:
    """What the draft pool's manager needs of a request: its id, the tokens the draft cache holds or is
    about to hold, and how many of them have K/V."""
    request_id: str
    cache_salt: str | None
    tokens: list[int]
    num_computed_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    num_hashed_blocks: int = 0
    prompt_logprobs = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class DraftModelCache:
    def __init__(self, draft_model, target_runner, num_blocks: int, block_size: int, prefix_caching: bool):
        """num_blocks: the draft pool's size (the engine gives it as many blocks as the target's pool)."""
        target = target_runner.model
        if draft_model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from the "
                             f"model's ({target.cfg.vocab_size}): its tokens would mean other things")
        pool_cls = PrefixCachingPool if prefix_caching else BlockPool
        pool = pool_cls(draft_model.cfg, num_blocks, block_size, draft_model.dtype, draft_model.device)
        self.kv = KVCacheManager(pool)
        self.forward = PagedForward(draft_model, self.kv, target_runner.attention)   # the draft's own passes
        self.seqs: dict[str, DraftSequence] = {}
        self.pass_times: list[tuple[int, float]] = []   # the last proposal's passes: (sequences, seconds)

    def free(self, req) -> None:
        """Give back req's draft blocks (the full ones stay findable in the draft pool's prefix cache)."""
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def _ready(self, req, room: int) -> DraftSequence | None:
        """req's draft cache, rolled back to the prefix of req's tokens it holds and grown for the
        catch-up and room - 1 drafts; None if the draft pool lacks the blocks (req decodes plainly)."""
        tokens, kv = req.all_token_ids, self.kv
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = DraftSequence(req.request_id, req.cache_salt, list(tokens))
            cached = kv.computed_blocks(seq)
            held = len(cached) * kv.block_size
            if kv.blocks_to_admit(seq, cached, len(tokens) + room - 1 - held) > kv.num_free_blocks:
                return None
            seq.num_computed_tokens = kv.admit(seq, cached)
            self.seqs[req.request_id] = seq
        else:
            same = 0
            for a, b in zip(seq.tokens[:seq.num_computed_tokens], tokens):
                if a != b:
                    break
                same += 1
            seq.num_computed_tokens = min(same, len(tokens) - 1)     # the last token runs: its logits are needed
            seq.tokens = list(tokens)
            kv.cache_full_blocks(seq)                                 # accepted tokens only: never rolled back
            kv.truncate(seq, seq.num_computed_tokens)
        more = len(tokens) + room - 1 - kv.num_slots(seq)
        if more > 0:
            if not kv.can_append(seq, more):
                return None
            kv.append(seq, more)
        return seq

    @torch.inference_mode()
    def propose(self, reqs: list, room: list[int]) -> None:
        """Fill req.spec_token_ids (and spec_probs) of each request, up to its room (none where the draft
        pool is full)."""
        ready, self.pass_times = [], []
        for req, s in zip(reqs, room):
            req.spec_token_ids, req.spec_probs = [], None
            seq = self._ready(req, s)
            if seq is not None:
                ready.append((req, s, seq))
        if not ready:
            return
        catch_up = pack((seq.num_computed_tokens, seq.tokens[seq.num_computed_tokens:]) for _, _, seq in ready)
        for _, _, seq in ready:                                    # catch up: the tokens each cache lacks
            seq.num_computed_tokens = seq.num_tokens
        tables = [self.kv.block_table(seq) for _, _, seq in ready]
        t0 = time.perf_counter()
        logits = self.forward(catch_up, tables, catch_up.last_rows())                 # (A, vocab)
        if max(catch_up.q_lens) <= max(room) + 1:   # a catch-up on the last step's tokens, not a first prefill
            self.pass_times.append((len(ready), time.perf_counter() - t0))
        active = list(range(len(ready)))
        drafts: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        for j in range(max(s for _, s, _ in ready)):
            for row, i in enumerate(active):
                req = ready[i][0]
                token, q = pick_draft(logits[row], req.params, req.generator)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if ready[i][1] > j + 1]       # still drafting: feed its last draft
            if not active:
                break
            seqs = [ready[i][2] for i in active]
            step = pack((seq.num_tokens, [drafts[i][-1]]) for i, seq in zip(active, seqs))
            for seq, token in zip(seqs, step.ids):
                seq.tokens.append(token)
                seq.num_computed_tokens += 1
            t0 = time.perf_counter()
            logits = self.forward(step, [self.kv.block_table(s) for s in seqs], step.last_rows())   # (A', vocab)
            self.pass_times.append((len(seqs), time.perf_counter() - t0))
        for i, (req, _, _) in enumerate(ready):
            req.spec_token_ids = drafts[i]
            req.spec_probs = torch.stack(probs[i]) if probs[i] else None
