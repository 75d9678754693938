"""Speculative decoding on four task types: every proposer against plain kv decoding, one stream, greedy.

    python benchmarks/speculative.py [--max-tokens 128] [--out benchmarks/results/cpu_speculative.json]

For each prompt of data/speculative_tasks.jsonl (chat Q&A; summarising a given passage; editing given
code; extracting fields from a given text into JSON), plain kv decoding and each (proposer, k) run one
after the other, so a slow patch of the machine hits them all. Also measures what a pass over
1..9 new tokens costs relative to one (on a CPU more rows are not free) and the cost ratio c of
each layer-skipping draft. Notebook 10 plots the result.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.course.speculative_bench import draft_cost, pass_costs, run_tasks, summarize_tasks

CONFIGS = [("ngram", 2), ("ngram", 4), ("ngram", 8), ("layers:24", 2), ("layers:24", 4), ("layers:15", 2)]
# --adaptive: each step drafts 0..k tokens where it pays (speculative/adaptive.py), against fixed k = 4
ADAPTIVE = [("ngram", 4), ("ngram", 4, "adaptive"), ("ngram", 8, "adaptive"), ("layers:24", 4, "adaptive")]


# --draft: the model's quantized copy as the draft (speculative/proposers.py), alone and after n-gram lookup
DRAFT = [("ngram", 4), ("draft:q4", 3), ("draft:q4", 5), ("draft:int8", 4), ("ngram+draft:q4", 5),
         ("draft:q4", 6, "adaptive")]

ENGINE = [(None, 0), ("ngram", 4), ("ngram", 4, "adaptive"), ("ngram", 8, "adaptive")]
# --engine-only: plain, fixed k, and adaptive k <= 8 as it runs and with a probe every 4 plain steps whatever
# the drafts did (MAX_WAIT = 4: how adaptive speculation probed before the waits between probes grew)
ENGINE_PROBES = [(None, 0), ("ngram", 4), ("ngram", 8, "adaptive", "probe every 4"), ("ngram", 8, "adaptive")]
ENGINE_DRAFT = [(None, 0), ("draft:q4", 4), ("ngram+draft:q4", 4), ("draft:q4", 4, "adaptive")]


def engine_runs(model, tok, tasks, batches: list[int], max_tokens: int, repeats: int, systems=ENGINE) -> list[dict]:
    """The serving engine over all task prompts at once, at each max_num_seqs in `batches`: each of `systems`
    (no speculation first) taking turns `repeats` times; output tokens per second (median)."""
    import statistics
    import time

    from minillm import LLM
    from minillm.backends import backend_of
    from minillm.sampling import SamplingParams
    from minillm.speculative import adaptive

    prompts = [tok.apply_chat_template([{"role": "user", "content": t["prompt"]}]) for t in tasks]
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    for b in batches:
        engines = {i: LLM(model, tok, backend=backend_of(model), max_num_seqs=b, speculative=spec,
                          num_speculative_tokens=k or 4,
                          adaptive_speculation="adaptive" in mode, verbose=False)
                   for i, (spec, k, *mode) in enumerate(systems)}
        rates: dict[int, list[float]] = {i: [] for i in engines}
        ids: dict[int, list] = {}
        waits = {i: 4 if "probe every 4" in mode else adaptive.MAX_WAIT for i, (_, _, *mode) in enumerate(systems)}
        kept = adaptive.MAX_WAIT
        for i, llm in engines.items():                 # warm-up, not timed: kernels chosen, step times seen
            adaptive.MAX_WAIT = waits[i]
            llm.generate(prompts, SamplingParams(max_tokens=32), use_tqdm=False)
        for _ in range(repeats):
            for i, llm in engines.items():
                adaptive.MAX_WAIT = waits[i]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rates[i].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
                ids[i] = [o.token_ids for o in outs]
        adaptive.MAX_WAIT = kept
        base = statistics.median(rates[0])
        for i, (spec, k, *mode) in enumerate(systems):
            stats = engines[i].engine.stats()
            rows.append({"max_num_seqs": b, "system": " ".join(filter(None, [spec or "plain", *mode])), "k": k,
                         "output_tokens_per_s": statistics.median(rates[i]), "speedup": statistics.median(rates[i]) / base,
                         "same": ids[i] == ids[0], "spec_draft_tokens": stats["spec_draft_tokens"],
                         "spec_accepted_tokens": stats["spec_accepted_tokens"]})
            print(f"max_num_seqs {b:3d}  {rows[-1]['system']:15s} {rows[-1]['output_tokens_per_s']:7.1f} tok/s  "
                  f"x{rows[-1]['speedup']:.2f}  same={rows[-1]['same']}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tasks", default=str(Path(__file__).parents[1] / "data" / "speculative_tasks.jsonl"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="default results/cpu_speculative.json "
                                                 "(with --adaptive: results/cpu_speculative_adaptive.json)")
    ap.add_argument("--adaptive", action="store_true", help="adaptive k against fixed k (the ADAPTIVE configs)")
    ap.add_argument("--draft", action="store_true", help="the quantized copy as the draft (the DRAFT configs)")
    ap.add_argument("--per-task", type=int, default=None, help="only the first N prompts of each task type")
    ap.add_argument("--repeats", type=int, default=1, help="turns per prompt; tokens/s is the median (default 1)")
    ap.add_argument("--engine", default=None, metavar="B,B,...",
                    help="with --adaptive or --draft: also the serving engine over all the prompts at these "
                         "max_num_seqs")
    ap.add_argument("--engine-only", action="store_true",
                    help="with --engine: only the engine runs (plain, fixed k, adaptive k with and without growing "
                         "waits between probes), no single-stream tasks")
    ap.add_argument("--backend", default="torch", choices=("torch", "native", "auto"),
                    help="the model's layers: plain PyTorch (default, as notebook 10 runs) or the native backend's, "
                         "as the command line runs them (one stream as `generate` does; the engine with its float "
                         "weights packed, as `serve` does)")
    args = ap.parse_args()
    name = "cpu_speculative_draft.json" if args.draft else \
        "cpu_speculative_adaptive.json" if args.adaptive else "cpu_speculative.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    served = model
    if args.backend != "torch":
        from minillm.backends import apply_backend
        served = apply_backend(model, args.backend, pack_weights=True) if args.engine else None
        model = apply_backend(model, args.backend)
    tasks = [json.loads(line) for line in open(args.tasks)]
    if args.per_task:
        tasks = [t for i, t in enumerate(tasks) if [u["task"] for u in tasks[:i]].count(t["task"]) < args.per_task]
    configs = DRAFT if args.draft else ADAPTIVE if args.adaptive else CONFIGS
    if args.engine_only and not args.engine:
        ap.error("--engine-only needs --engine B,B,...")
    costs = pass_costs(model)
    c = {n: draft_cost(model, n) for n in ((15, 24) if not args.draft else ("q4", "int8"))}
    rows = [] if args.engine_only else run_tasks(model, tok, tasks, configs, max_tokens=args.max_tokens,
                                                 repeats=args.repeats)
    systems = ENGINE_PROBES if args.engine_only else ENGINE_DRAFT if args.draft else ENGINE
    engine = engine_runs(served, tok, tasks, [int(b) for b in args.engine.split(",")], args.max_tokens,
                         args.repeats, systems) if args.engine else None
    info = machine_info()
    result = {"machine": info["cpu"], **provenance(), "gpu": info["gpu"], "torch": info["torch"],
              "threads": info["threads"], "backend": args.backend,
              "dtype": "float32", "max_tokens": args.max_tokens, "configs": configs, "repeats": args.repeats,
              "pass_cost_s": costs, "draft_cost_ratio": c, "rows": rows, "summary": summarize_tasks(rows),
              **({"engine": engine} if engine else {})}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for s in result["summary"]:
        print(f"{s['task']:10s} {s['system']:19s} k={s['k']}  x{s['speedup_median']:.2f}  "
              f"acceptance {s['acceptance_rate']:.0%}  {s['mean_accepted_tokens']:.2f}/pass  same={s['all_same']}")
    print("pass cost vs 1 token: " + ", ".join(f"{T}: {t / costs[1]:.2f}" for T, t in costs.items()))
    print(f"draft cost ratio c: {c}  ({info['cpu']}, {info['threads']} threads)")


if __name__ == "__main__":
    main()
