"""A 500-token system prompt shared by every request, short questions after it: prefix caching off and on.

    python benchmarks/prefix_caching.py [--out benchmarks/results/cpu_prefix_caching.json]

The same workload (48 requests, Poisson arrivals at 1 per second, at most 16 in flight; each prompt is
the shared 500 tokens plus a question of the trace's length x 0.1, answers x 0.1) is replayed through
the continuous engine with prefix caching off, then on, in one run. Writes both summaries (TTFT, ITL,
throughput, hit rate). Notebook 09 shows the result.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.course.bench_serve import load_workload, run_serve_bench


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared-prefix-tokens", type=int, default=500)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_prefix_caching.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    items = load_workload(num_requests=args.num_requests, length_scale=0.1, request_rate=args.request_rate,
                          shared_prefix_tokens=args.shared_prefix_tokens, seed=1)
    results = []
    for caching in (False, True):
        [r], _ = run_serve_bench(model, tok, items, ["continuous"], max_concurrency=args.max_concurrency,
                                 engine_options={"enable_prefix_caching": caching})
        r["system"] = f"continuous, prefix caching {'on' if caching else 'off'}"
        results.append(r)
        print(json.dumps({k: r[k] for k in ("system", "output_tokens_per_s", "prefix_cache_hit_rate")}
                         | {"ttft_p50_s": r["ttft_s"]["p50"]}), flush=True)
    workload = {"num_requests": len(items), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                "shared_prefix_tokens": args.shared_prefix_tokens,
                "mean_prompt_tokens": sum(len(w.prompt_ids) for w in items) / len(items),
                "mean_output_tokens": sum(w.output_len for w in items) / len(items)}
    Path(args.out).write_text(json.dumps({"machine": machine_info(), **provenance(), "workload": workload, "results": results}, indent=1))


if __name__ == "__main__":
    main()
