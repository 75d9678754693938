"""The generation loop: prefill the prompt, then decode one token at a time.

A *runner* (`stages.py`) is what changes between stages: it turns token ids into
next-token logits. Stage 1's runner keeps nothing between steps, so step t costs a
forward pass over t tokens; stage 2's keeps a KV cache. This loop is the same for all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .detokenizer import IncrementalDetokenizer
from .stages import STAGES, NaiveRunner, make_runner  # noqa: F401  (re-exported)
from .sampling import SamplingParams, check_vocab, make_generator, penalize, sample_next_token
from .speculative.adaptive import speculation_settings

ALL_STAGES = [*STAGES, "continuous"]   # stage 5, the serving engine, streams through engine/


@dataclass
class Generation:
    """What one generate() call produced, with its timings."""
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""               # "stop" (end token or stop string) or "length"
    ttft_s: float = 0.0                   # prompt in -> first new token out
    token_times_s: list[float] = field(default_factory=list)  # time to produce each new token
    stage: str = "naive"
    # speculative decoding (vLLM's counters): verification passes that had drafts, drafted tokens, accepted ones
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Drafted tokens accepted per verification pass that had drafts (each pass adds one more token)."""
        return self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first, per second of decoding (0 if there was only one)."""
        decode = self.token_times_s[1:]
        return len(decode) / sum(decode) if decode and sum(decode) > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0


def check_prompt(prompt_ids: list[int], max_seq_len: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_seq_len}; "
                         f"shorten it to at most {max_seq_len - 1} tokens")


def stream(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
           stage: str = "naive", result: Generation | None = None,
           speculative=None, num_speculative_tokens: int | None = None, runner=None,
           kv_cache_dtype: str | None = None, enforce_eager: bool = False,
           adaptive_speculation: bool | None = None) -> Iterator[str]:
    """Generate, yielding text as it is decoded (never half a character, never part of a stop string).

    Pass a `Generation` as `result` to receive the token ids and timings as they happen.
    speculative: a proposer ('ngram', 'layers:N' or a `speculative.Proposer`) drafting up to
    num_speculative_tokens tokens per step for the model to verify (stage 6, `speculative/`).
    adaptive_speculation: draft 0..num_speculative_tokens tokens per step, as the sequence's own acceptance
    and the measured cost of a pass make worthwhile (`speculative/adaptive.py`); None (the default): on
    whenever `speculative` is given; False: num_speculative_tokens every step. num_speculative_tokens
    None: 8 adaptive, 4 fixed (`speculation_settings`).
    runner: run on this runner instead of a new one of the stage (rank 0 of a tensor-parallel run passes
    one that also drives the other ranks, `distributed/leader.py`).
    kv_cache_dtype: None (the model's dtype), "int8" or "int4": how the stage's cache stores K/V.
    enforce_eager: no CUDA graphs on a GPU (stages flash and continuous capture their decode steps).
    """
    params = params or SamplingParams()
    max_len = model.cfg.max_seq_len
    check_prompt(prompt_ids, max_len)
    check_vocab(params, model.cfg.vocab_size)
    if params.max_tokens == 0 or params.prompt_logprobs is not None:
        raise ValueError("scoring a prompt (prompt_logprobs, max_tokens=0) is the engine's: use minillm.LLM")
    if params.grammar is not None and stage != "continuous":
        raise ValueError("structured output (a grammar) is the serving engine's: use stage 'continuous' or minillm.LLM")
    if speculative is not None and params.penalized:
        raise ValueError("penalties and logit_bias change each token's logits by the tokens before it, so "
                         "they are sampled one at a time: drop speculative, or the penalties")
    adaptive_speculation, num_speculative_tokens = speculation_settings(speculative, adaptive_speculation,
                                                                        num_speculative_tokens)
    if stage == "continuous":
        yield from _stream_engine(model, tokenizer, prompt_ids, params, result, speculative, num_speculative_tokens,
                                  kv_cache_dtype, enforce_eager, adaptive_speculation)
        return
    out = result if result is not None else Generation(prompt_tokens=len(prompt_ids))
    out.prompt_tokens, out.stage = len(prompt_ids), stage
    detok = IncrementalDetokenizer(tokenizer, params, min(params.max_tokens, max_len - len(prompt_ids)))
    out.token_ids = detok.token_ids
    if speculative is not None:
        from .speculative.decode import speculative_decode

        yield from speculative_decode(model, prompt_ids, params, stage, speculative, num_speculative_tokens,
                                      detok, out, kv_cache_dtype, adaptive_speculation)
        return
    if runner is None:
        runner = make_runner(model, stage, min(len(prompt_ids) + params.max_tokens, max_len), kv_cache_dtype,
                             enforce_eager)
    gen = make_generator(params.seed)

    t0 = time.perf_counter()
    logits = runner.prefill(prompt_ids)
    while True:
        logits = penalize(logits, params, prompt_ids, detok.token_ids)         # (vocab,) unchanged if none
        token = int(sample_next_token(logits[None], params, gen)[0])
        now = time.perf_counter()
        out.token_times_s.append(now - t0)
        if len(out.token_times_s) == 1:
            out.ttft_s = now - t0
        t0 = now
        detok.push(token)
        if chunk := detok.take():
            yield chunk
        if detok.done:
            break
        logits = runner.decode(token)
    out.text, out.finish_reason = detok.text, detok.finish_reason


def _stream_engine(model, tokenizer, prompt_ids, params, result, speculative=None, k=4,
                   kv_cache_dtype=None, enforce_eager=False, adaptive_speculation=None) -> Iterator[str]:
    """Stage 5 for one prompt: the serving engine with a pool just big enough for it."""
    from .engine import LLM

    block = 16
    extra = k + 1 if speculative is not None else 0          # room for drafts being verified
    blocks = -(-min(len(prompt_ids) + params.max_tokens + extra, model.cfg.max_seq_len) // block)
    llm = LLM(model, tokenizer, max_num_seqs=1, block_size=block, num_blocks=blocks, verbose=False,
              speculative=speculative, num_speculative_tokens=k, kv_cache_dtype=kv_cache_dtype,
              enforce_eager=enforce_eager, adaptive_speculation=adaptive_speculation)
    out = result if result is not None else Generation(prompt_tokens=len(prompt_ids))
    out.prompt_tokens, out.stage = len(prompt_ids), "continuous"
    for o in llm.stream(prompt_ids, params):
        if o.new_text:
            yield o.new_text
    out.token_ids, out.text, out.finish_reason = o.token_ids, o.text, o.finish_reason
    stats = llm.engine.stats()
    out.spec_drafts, out.spec_draft_tokens = stats["spec_drafts"], stats["spec_draft_tokens"]
    out.spec_accepted_tokens = stats["spec_accepted_tokens"]
    out.ttft_s = o.metrics.ttft_s or 0.0
    out.token_times_s = ([out.ttft_s] + o.metrics.itl_s) if o.metrics.ttft_s is not None else []


def generate(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
             stage: str = "naive", speculative=None, num_speculative_tokens: int | None = None, runner=None,
             kv_cache_dtype: str | None = None, enforce_eager: bool = False,
             adaptive_speculation: bool | None = None) -> Generation:
    """Generate to the end and return the ids, text and timings (and, with `speculative`, its counters)."""
    out = Generation(prompt_tokens=len(prompt_ids))
    for _ in stream(model, tokenizer, prompt_ids, params, stage, result=out,
                    speculative=speculative, num_speculative_tokens=num_speculative_tokens, runner=runner,
                    kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
                    adaptive_speculation=adaptive_speculation):
        pass
    return out


def generate_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams | None = None,
                   stage: str = "kv", kv_cache_dtype: str | None = None) -> list[Generation]:
    """Generate for several prompts at once (static batching: the batch runs until every
    sequence is done). Each result is what the prompt would give alone."""
    params = params or SamplingParams()
    max_len = model.cfg.max_seq_len
    for p in prompts:
        check_prompt(p, max_len)
    check_vocab(params, model.cfg.vocab_size)
    if params.grammar is not None:
        raise ValueError("structured output (a grammar) is the serving engine's: use minillm.LLM")
    runner = make_runner(model, stage, min(max(map(len, prompts)) + params.max_tokens, max_len), kv_cache_dtype)
    gen = make_generator(params.seed)
    outs = [Generation(prompt_tokens=len(p), stage=stage) for p in prompts]
    detoks = [IncrementalDetokenizer(tokenizer, params, min(params.max_tokens, max_len - len(p))) for p in prompts]
    t0 = time.perf_counter()
    logits = runner.prefill_batch(prompts)                                    # (B, vocab)
    while True:
        if params.penalized:
            logits = torch.stack([penalize(row, params, p, d.token_ids) for row, p, d in zip(logits, prompts, detoks)])
        tokens = sample_next_token(logits, params, gen).tolist()              # (B,)
        now = time.perf_counter()
        for out, detok, token in zip(outs, detoks, tokens):
            if detok.done:                  # static batching: it rides along until the others end
                continue
            out.token_times_s.append(now - t0)
            if len(out.token_times_s) == 1:
                out.ttft_s = now - t0
            detok.push(token)
        t0 = now
        if all(d.done for d in detoks):
            break
        logits = runner.decode_batch(tokens)
    for out, detok in zip(outs, detoks):
        out.token_ids, out.text, out.finish_reason = detok.token_ids, detok.text, detok.finish_reason
    return outs
