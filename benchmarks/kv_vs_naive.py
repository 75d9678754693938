"""Stage 1 vs stage 2 on one long generation: time of every step, both stages, same tokens.

    python benchmarks/kv_vs_naive.py [--max-tokens 512] [--out benchmarks/results/cpu_kv_vs_naive.json]

The naive stage at 512 tokens takes minutes on a laptop CPU: that is the point.
Writes per-step times and the speedup at 64, 128, 256 and 512 generated tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.generate import generate
from minillm.sampling import SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_kv_vs_naive.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    generate(model, tok, ids, SamplingParams(max_tokens=4), "kv")  # warm-up
    runs = {}
    for stage in ("kv", "naive", "kv"):  # kv twice, around naive: a drift in machine speed shows
        g = generate(model, tok, ids, params, stage)
        runs.setdefault(stage, []).append(g)
        print(f"{stage}: {sum(g.token_times_s):.1f} s for {len(g.token_ids)} tokens", flush=True)
    kv = min(runs["kv"], key=lambda g: sum(g.token_times_s))
    naive = runs["naive"][0]
    assert kv.token_ids == naive.token_ids, "stages disagree: a correctness bug, not a benchmark result"
    speedup = {n: sum(naive.token_times_s[:n]) / sum(kv.token_times_s[:n])
               for n in (64, 128, 256, 512) if n <= args.max_tokens}
    report = {"machine": machine_info(), **provenance(), "prompt_tokens": len(ids), "max_tokens": args.max_tokens,
              "same_tokens": True, "speedup_at": speedup,
              "step_s": {"naive": naive.token_times_s, "kv": kv.token_times_s}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"speedup_at": speedup}))


if __name__ == "__main__":
    main()
