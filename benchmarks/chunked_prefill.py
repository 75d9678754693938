"""A 2,000-token prompt arriving among 16 decoding requests: the token budget against latency.

    python benchmarks/chunked_prefill.py [--out benchmarks/results/cpu_chunked_prefill.json]

For each budget (64 ... 2,048 tokens per step, and chunking off), the 16 background requests
(100-token prompts, 96 answer tokens each) start together; at step 10 the long prompt arrives.
Writes, per budget, the long prompt's time to first token and the background requests'
inter-token latencies (p50, p90, p99, max). Notebook 08 plots the result.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.course.bench_serve import long_prompt_interference
from minillm.engine import LLMEngine
from minillm.course.timing import percentile

BUDGETS = [64, 128, 256, 512, 1024, 2048]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=2000, help="tokens in the long prompt")
    ap.add_argument("--background", type=int, default=16, help="requests decoding when it arrives")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_chunked_prefill.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    g = torch.Generator().manual_seed(0)
    background = [torch.randint(1000, 40000, (100,), generator=g).tolist() for _ in range(args.background)]
    long_prompt = torch.randint(1000, 40000, (args.long,), generator=g).tolist()
    max_len = args.long + 304
    configs = [{"budget": b, "chunked": True} for b in BUDGETS] + [{"budget": max_len, "chunked": False}]
    rows = []
    for cfg in configs:
        engine = LLMEngine(model, tok, kv_cache_memory=512 << 20, max_model_len=max_len, verbose=False,
                           max_num_batched_tokens=cfg["budget"], enable_chunked_prefill=cfg["chunked"])
        r = long_prompt_interference(engine, background, long_prompt, background_tokens=96, arrive_step=10)
        itl = r["itl_s"]
        rows.append({**cfg, "long_ttft_s": r["long_ttft_s"], "itl_p50_s": percentile(itl, 50),
                     "itl_p90_s": percentile(itl, 90), "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl),
                     "steps": len(r["steps"])})
        print(json.dumps(rows[-1]), flush=True)
    report = {"machine": machine_info(), **provenance(), "long_prompt_tokens": args.long, "background_requests": args.background,
              "background_prompt_tokens": 100, "background_output_tokens": 96, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
