"""Stage 6, one stream: draft k tokens, verify them in one target pass, keep what the rule accepts.

    prefill the prompt -> sample token t
    repeat:
        drafts = proposer.propose(tokens so far, k)             cheap guesses d_1..d_k
        logits = target.extend([t, d_1, ..., d_k])              one pass, k + 1 positions
        emitted = verify(drafts, q, p(logits))                  1 .. k + 1 tokens, exactly distributed
        target.truncate(cache length + len(emitted))            rejected drafts' K/V forgotten
        t = emitted[-1]                                         its K/V are computed next round

The cache after a round holds t and the accepted drafts; the last emitted token (the correction
or the bonus) is the next round's first input, exactly like a sampled token in plain decoding.
"""
from __future__ import annotations

import time
from typing import Iterator

from ..stages import make_runner
from ..sampling import SamplingParams, make_generator, sample_next_token
from .adaptive import AdaptiveK, measure_pass_costs
from .proposers import make_proposer
from .verify import target_probs, verify


def speculative_decode(model, prompt_ids: list[int], params: SamplingParams, stage: str, proposer, k: int,
                       detok, out, kv_cache_dtype: str | None = None, adaptive: bool = False,
                       pass_cost: dict[int, float] | None = None) -> Iterator[str]:
    """Yield text chunks as `detok` (the sequence's IncrementalDetokenizer) releases them; fill `out`
    (a generate.Generation) with the timings and the speculation counters. adaptive: draft 0..k tokens per
    step, as AdaptiveK chooses (adaptive.py), pricing passes with pass_cost ({T: time of a pass over T
    tokens}), measured on this runner after the prefill when not given."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1; got {k!r}")
    if stage not in ("kv", "flash", "paged"):
        raise ValueError(f"speculative decoding needs a stage with a KV cache to roll back: kv, flash, paged "
                         f"or continuous; got {stage!r}")
    proposer = make_proposer(proposer)
    P = len(prompt_ids)
    runner = make_runner(model, stage, min(P + params.max_tokens + k + 1, model.cfg.max_seq_len), kv_cache_dtype)
    gen = None if params.greedy else make_generator(params.seed)
    history = list(prompt_ids)

    t0 = time.perf_counter()
    logits = runner.prefill(prompt_ids)
    new = [int(sample_next_token(logits[None], params, gen)[0])]
    proposer.start(runner, params, gen)
    ctl = None
    if adaptive:
        m0 = time.perf_counter()
        ctl = AdaptiveK(k, pass_cost or measure_pass_costs(runner, k + 1), proposer.relative_cost(model))
        t0 += time.perf_counter() - m0           # a calibration, once per model and context size: not a token's time
    pending = None                               # the last pass's (drafts, drafts accepted), counted once emitted
    while True:
        now = time.perf_counter()
        if not out.token_times_s:
            out.ttft_s = now - t0
        out.token_times_s += [now - t0] + [0.0] * (len(new) - 1)   # a round's tokens arrive together
        t0 = now
        used = 0
        for token in new:
            used += 1
            history.append(token)
            detok.push(token)
            if chunk := detok.take():
                yield chunk
            if detok.done:
                break
        if pending is not None:                  # drafts accepted past the answer's end were never emitted
            out.spec_drafts += 1
            out.spec_draft_tokens += pending[0]
            out.spec_accepted_tokens += min(pending[1], used)
            pending = None
        if detok.done:
            break
        start = runner.length                                       # == len(history) - 1
        room = min(k, detok.remaining - 1, runner.max_len - start - 1)
        if ctl is not None:
            room = ctl.choose(room)                                    # 0: a plain decode step
        drafts, q = proposer.propose(history, room) if room > 0 else ([], None)
        if ctl is not None:
            drafts, q = ctl.trim(list(drafts), q, room)                 # fewer found: verify only if it pays
        logits = runner.extend([history[-1], *drafts])                 # (len(drafts) + 1, vocab)
        new = verify(drafts, q, target_probs(logits, params), gen)
        runner.truncate(start + len(new))                              # t + the accepted drafts
        if drafts:
            if ctl is not None:
                ctl.update(len(drafts), len(new) - 1)
            pending = (len(drafts), len(new) - 1)
    out.text, out.finish_reason = detok.text, detok.finish_reason
