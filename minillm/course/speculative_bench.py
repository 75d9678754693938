"""Measuring speculative decoding: what a verification pass costs, and what each proposer gains.

    pass_costs(model, context, max_tokens)    time of one pass over 1..T new tokens after a context,
                                              relative to one token: is a (k + 1)-token pass "free"?
    draft_cost(model, draft, context)         one draft step (the first N layers, or the model's quantized
                                              copy) / one full decode step
    run_tasks(model, tok, tasks, configs)     per prompt: plain kv decoding and each proposer, alternated
                                              in one run; tokens/s, acceptance, tokens per pass, exactness
    predicted_run_speedup(row, costs, ratios) what a run's counters predict, priced with the measured costs
    alpha_from_tokens_per_pass(tokens, k)     the per-draft acceptance α that E(α, k) tokens per pass implies
"""
from __future__ import annotations

import statistics

import numpy as np
import torch
from tqdm.auto import tqdm

from ..generate import generate
from .timing import alternate
from ..stages import make_runner
from ..sampling import SamplingParams


def _runner_after(model, context: int, max_len: int):
    runner = make_runner(model, "kv", max_len=max_len)
    runner.prefill(torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0)).tolist())
    return runner


def pass_costs(model, context: int = 200, max_tokens: int = 9, repeats: int = 7) -> dict[int, float]:
    """Median seconds of extend(T tokens) then truncate back, after `context` tokens, for T = 1..max_tokens."""
    runs = pass_cost_runs(model, context, max_tokens, repeats)
    return {T: statistics.median(ts) for T, ts in runs.items()}


def pass_cost_runs(model, context: int = 200, max_tokens: int = 9, repeats: int = 7) -> dict[int, list[float]]:
    """Seconds of each of `repeats` rounds of extend(T tokens) then truncate back, after `context` tokens,
    for T = 1..max_tokens. Rounds alternate over T, so a slow moment of the machine hits every T alike."""
    runner = _runner_after(model, context, context + max_tokens + 1)

    def step(T):
        runner.extend(list(range(100, 100 + T)))
        runner.truncate(context)
    return alternate({T: lambda T=T: step(T) for T in range(1, max_tokens + 1)}, rounds=repeats)


def draft_cost(model, draft: int | str, context: int = 200, repeats: int = 9) -> float:
    """c: one draft step / one full decode step. draft: N (the first N layers and the head) or a
    quantization format ("q4", "int8": the model's quantized copy, `speculative.quantized_copy`)."""
    from ..speculative import quantized_copy

    runners = {"target": _runner_after(model, context, context + 2)}
    if isinstance(draft, str):
        runners["draft"] = _runner_after(quantized_copy(model, draft), context, context + 2)
    layers = {"target": None, "draft": None if isinstance(draft, str) else draft}

    def step(who):
        r = runners.get(who, runners["target"])
        r.extend([123], n_layers=layers[who])
        r.truncate(context)
    times = alternate({who: lambda who=who: step(who) for who in layers}, rounds=repeats)   # a slow patch hits both
    return statistics.median(times["draft"]) / statistics.median(times["target"])


def run_tasks(model, tokenizer, tasks: list[dict], configs: list[tuple[str, int]], max_tokens: int = 128,
              progress: bool = True, repeats: int = 1) -> list[dict]:
    """For each task prompt: plain kv decoding, then every (proposer, k) or (proposer, k, "adaptive") (k at
    most, chosen per step: speculative/adaptive.py), in one alternating run. Returns a row per (prompt,
    system) with decode tokens/s, the speculative counters and `same` (greedy tokens identical to plain
    decoding). repeats > 1: each prompt's systems take turns that many times, and a row's tokens/s is the
    median of its turns (the machine's slow moments hit every system alike)."""
    params = SamplingParams(max_tokens=max_tokens)
    warm = tokenizer.apply_chat_template([{"role": "user", "content": tasks[0]["prompt"]}])
    generate(model, tokenizer, warm, SamplingParams(max_tokens=8), stage="kv")       # warm-up, not timed
    for spec, k, *mode in configs:
        generate(model, tokenizer, warm, SamplingParams(max_tokens=8), stage="kv", speculative=spec,
                 num_speculative_tokens=k, adaptive_speculation="adaptive" in mode)
    rows = []
    bar = tqdm(total=len(tasks) * (1 + len(configs)) * repeats, desc="speculative", disable=not progress)
    for t in tasks:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": t["prompt"]}])
        turns: dict[int, list] = {}
        for _ in range(repeats):
            for i, (spec, k, *mode) in enumerate([(None, 0), *configs]):
                turns.setdefault(i, []).append(generate(
                    model, tokenizer, ids, params, stage="kv", speculative=spec, num_speculative_tokens=k or 4,
                    adaptive_speculation="adaptive" in mode))
                bar.update()
        rate = {i: statistics.median(g.decode_tokens_per_s for g in gs) for i, gs in turns.items()}
        base = turns[0][0]
        rows.append({"task": t["task"], "name": t["name"], "system": "kv", "k": 0,
                     "tokens": len(base.token_ids), "decode_tokens_per_s": rate[0], "same": True})
        for i, (spec, k, *mode) in enumerate(configs, start=1):
            g = turns[i][0]
            rows.append({"task": t["task"], "name": t["name"], "system": " ".join([spec, *mode]), "k": k,
                         "tokens": len(g.token_ids), "decode_tokens_per_s": rate[i],
                         "same": all(x.token_ids == base.token_ids for x in turns[i]),
                         "acceptance_rate": g.acceptance_rate, "mean_accepted_tokens": g.mean_accepted_tokens,
                         "spec_drafts": g.spec_drafts, "spec_draft_tokens": g.spec_draft_tokens,
                         "spec_accepted_tokens": g.spec_accepted_tokens, "speedup": rate[i] / rate[0]})
    bar.close()
    return rows


def summarize_tasks(rows: list[dict]) -> list[dict]:
    """Per task type and system: median speedup over kv, acceptance (pooled over prompts), tokens per pass."""
    out = []
    keys = sorted({(r["task"], r["system"], r["k"]) for r in rows if r["system"] != "kv"},
                  key=lambda x: (x[0], x[1], x[2]))
    for task, system, k in keys:
        rs = [r for r in rows if (r["task"], r["system"], r["k"]) == (task, system, k)]
        drafted = sum(r["spec_draft_tokens"] for r in rs)
        accepted = sum(r["spec_accepted_tokens"] for r in rs)
        passes = sum(r["spec_drafts"] for r in rs)
        out.append({"task": task, "system": system, "k": k, "prompts": len(rs),
                    "speedup_median": statistics.median(r["speedup"] for r in rs),
                    "acceptance_rate": accepted / drafted if drafted else 0.0,
                    "mean_accepted_tokens": accepted / passes if passes else 0.0,
                    "all_same": all(r["same"] for r in rs)})
    return out


def predicted_run_speedup(row: dict, pass_cost_s: dict, draft_cost_ratio: dict) -> float:
    """The speedup a run's own counters predict, priced with measured costs, in units of one decode step.

    row               one run of `run_tasks`: tokens, spec_drafts (verification passes), spec_draft_tokens,
                      spec_accepted_tokens, system ("ngram", "layers:N", ...)
    pass_cost_s       {tokens in a pass: seconds} (`pass_costs`); a pass over d + 1 tokens is interpolated
    draft_cost_ratio  {N or format: a draft step of the first N layers, or of the quantized copy, / a decode
                      step} (`draft_cost`); n-gram: free (after "ngram+", every draft is priced as the copy's)

    The run emits tokens - 1 tokens after the first; every pass emits 1 + its accepted drafts, so it made
    tokens - 1 - accepted passes: spec_drafts of them verify drafts (their width: drafted / spec_drafts + 1),
    the rest are plain one-token steps."""
    cost = {int(t): s for t, s in pass_cost_s.items()}
    widths = sorted(cost)
    relative = lambda width: float(np.interp(width, widths, [cost[w] / cost[1] for w in widths]))  # noqa: E731
    emitted = row["tokens"] - 1
    passes, verifies = emitted - row["spec_accepted_tokens"], row["spec_drafts"]
    width = row["spec_draft_tokens"] / max(verifies, 1) + 1
    ratios = {(f"layers:{n}" if str(n).isdigit() else f"draft:{n}"): r for n, r in draft_cost_ratio.items()}
    draft = ratios.get(row["system"].split()[0].split("+")[-1], 0.0)
    steps = (passes - verifies) + verifies * relative(width) + draft * row["spec_draft_tokens"]
    return emitted / steps


def alpha_from_tokens_per_pass(tokens_per_pass: float, k: int) -> float:
    """The α with (1 - α^(k+1)) / (1 - α) = tokens_per_pass (1 .. k + 1): the chance each draft is
    accepted, given the first k drafts' outcomes, that a run's mean tokens per pass implies (bisection)."""
    from ..speculative import expected_tokens_per_step

    if not 1 <= tokens_per_pass <= k + 1:
        raise ValueError(f"a pass of k = {k} drafts emits 1 to {k + 1} tokens; got {tokens_per_pass}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tokens_per_pass else (lo, mid)
    return (lo + hi) / 2
