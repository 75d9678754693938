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
from minillm.course.bench import machine_info
from minillm.course.speculative_bench import draft_cost, pass_costs, run_tasks, summarize_tasks

CONFIGS = [("ngram", 2), ("ngram", 4), ("ngram", 8), ("layers:24", 2), ("layers:24", 4), ("layers:15", 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tasks", default=str(Path(__file__).parents[1] / "data" / "speculative_tasks.jsonl"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_speculative.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    tasks = [json.loads(line) for line in open(args.tasks)]
    costs = pass_costs(model)
    c = {n: draft_cost(model, n) for n in (15, 24)}
    rows = run_tasks(model, tok, tasks, CONFIGS, max_tokens=args.max_tokens)
    info = machine_info()
    result = {"machine": info["cpu"], "gpu": info["gpu"], "torch": info["torch"], "threads": info["threads"],
              "dtype": "float32", "max_tokens": args.max_tokens, "configs": CONFIGS,
              "pass_cost_s": costs, "draft_cost_ratio": c, "rows": rows, "summary": summarize_tasks(rows)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for s in result["summary"]:
        print(f"{s['task']:10s} {s['system']:10s} k={s['k']}  x{s['speedup_median']:.2f}  "
              f"acceptance {s['acceptance_rate']:.0%}  {s['mean_accepted_tokens']:.2f}/pass  same={s['all_same']}")
    print(f"pass cost vs 1 token: " + ", ".join(f"{T}: {t / costs[1]:.2f}" for T, t in costs.items()))
    print(f"draft cost ratio c: {c}  ({info['cpu']}, {info['threads']} threads)")


if __name__ == "__main__":
    main()
