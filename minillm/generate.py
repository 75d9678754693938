"""The generation loop: prefill the prompt, then decode one token at a time.

A *runner* (`runners.py`) is what changes between stages: it turns token ids into
next-token logits. Stage 1's runner keeps nothing between steps, so step t costs a
forward pass over t tokens; stage 2's keeps a KV cache. This loop is the same for all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .runners import STAGES, NaiveRunner, make_runner  # noqa: F401  (re-exported)

ALL_STAGES = [*STAGES, "continuous"]   # stage 5, the serving engine, streams through engine/
from .sampling import SamplingParams, make_generator, sample_next_token


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

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first, per second of decoding (0 if there was only one)."""
        decode = self.token_times_s[1:]
        return len(decode) / sum(decode) if decode and sum(decode) > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0


def first_stop(text: str, stops) -> int:
    """Where the earliest stop string starts in text, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def check_prompt(prompt_ids: list[int], max_seq_len: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_seq_len}; "
                         f"shorten it to at most {max_seq_len - 1} tokens")


def stream(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
           stage: str = "naive", result: Generation | None = None) -> Iterator[str]:
    """Generate, yielding text as it is decoded (never half a character, never part of a stop string).

    Pass a `Generation` as `result` to receive the token ids and timings as they happen.
    """
    params = params or SamplingParams()
    max_len = model.cfg.max_seq_len
    check_prompt(prompt_ids, max_len)
    if stage == "continuous":
        yield from _stream_engine(model, tokenizer, prompt_ids, params, result)
        return
    runner = make_runner(model, stage, max_len=min(len(prompt_ids) + params.max_tokens, max_len))
    gen = make_generator(params.seed)
    out = result if result is not None else Generation(prompt_tokens=len(prompt_ids))
    out.prompt_tokens, out.stage = len(prompt_ids), stage
    decoder = tokenizer.stream_decoder()
    stop_ids = set() if params.ignore_eos else tokenizer.stop_ids
    hold = max((len(s) for s in params.stop), default=1) - 1  # chars kept back: could start a stop string
    text, sent, cut = "", 0, -1

    t0 = time.perf_counter()
    logits = runner.prefill(prompt_ids)
    for step in range(params.max_tokens):
        token = int(sample_next_token(logits[None], params, gen)[0])
        now = time.perf_counter()
        out.token_times_s.append(now - t0)
        if step == 0:
            out.ttft_s = now - t0
        t0 = now
        if token in stop_ids:
            out.finish_reason = "stop"
            break
        out.token_ids.append(token)
        text += decoder.push(token)
        cut = first_stop(text, params.stop)
        if cut >= 0:
            text, out.finish_reason = text[:cut], "stop"
            break
        if len(text) - hold > sent:
            yield text[sent:len(text) - hold]
            sent = len(text) - hold
        if step == params.max_tokens - 1 or len(prompt_ids) + len(out.token_ids) >= max_len:
            out.finish_reason = "length"
            break
        logits = runner.decode(token)
    if out.finish_reason != "stop" or cut < 0:
        text += decoder.flush()
    out.text = text
    if len(text) > sent:
        yield text[sent:]


def _stream_engine(model, tokenizer, prompt_ids, params, result) -> Iterator[str]:
    """Stage 5 for one prompt: the serving engine with a pool just big enough for it."""
    from .engine import LLM

    block = 16
    blocks = -(-min(len(prompt_ids) + params.max_tokens, model.cfg.max_seq_len) // block)
    llm = LLM(model, tokenizer, max_num_seqs=1, block_size=block, num_blocks=blocks, verbose=False)
    out = result if result is not None else Generation(prompt_tokens=len(prompt_ids))
    out.prompt_tokens, out.stage = len(prompt_ids), "continuous"
    sent = 0
    for o in llm.stream(prompt_ids, params):
        if len(o.text) > sent:
            yield o.text[sent:]
            sent = len(o.text)
    out.token_ids, out.text, out.finish_reason = o.token_ids, o.text, o.finish_reason
    out.ttft_s = o.metrics.ttft_s or 0.0
    out.token_times_s = ([out.ttft_s] + o.metrics.itl_s) if o.metrics.ttft_s is not None else []


def generate(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
             stage: str = "naive") -> Generation:
    """Generate to the end and return the ids, text and timings."""
    out = Generation(prompt_tokens=len(prompt_ids))
    for _ in stream(model, tokenizer, prompt_ids, params, stage, result=out):
        pass
    return out


def generate_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams | None = None,
                   stage: str = "kv") -> list[Generation]:
    """Generate for several prompts at once (static batching: the batch runs until every
    sequence is done). Each result is what the prompt would give alone."""
    params = params or SamplingParams()
    max_len = model.cfg.max_seq_len
    for p in prompts:
        check_prompt(p, max_len)
    runner = make_runner(model, stage, max_len=min(max(map(len, prompts)) + params.max_tokens, max_len))
    gen = make_generator(params.seed)
    outs = [Generation(prompt_tokens=len(p), stage=stage) for p in prompts]
    stop_ids = set() if params.ignore_eos else tokenizer.stop_ids
    t0 = time.perf_counter()
    logits = runner.prefill_batch(prompts)                                    # (B, vocab)
    for step in range(params.max_tokens):
        tokens = sample_next_token(logits, params, gen).tolist()              # (B,)
        now = time.perf_counter()
        for out, p, token in zip(outs, prompts, tokens):
            if out.finish_reason:
                continue
            out.token_times_s.append(now - t0)
            if step == 0:
                out.ttft_s = now - t0
            if token in stop_ids:
                out.finish_reason = "stop"
            else:
                out.token_ids.append(token)
                if len(out.token_ids) == params.max_tokens or len(p) + len(out.token_ids) >= max_len:
                    out.finish_reason = "length"
        t0 = now
        if all(o.finish_reason for o in outs):
            break
        logits = runner.decode_batch(tokens)
    for out in outs:
        out.text = tokenizer.decode(out.token_ids)
        cut = first_stop(out.text, params.stop)
        if cut >= 0:
            out.text, out.finish_reason = out.text[:cut], "stop"
    return outs
