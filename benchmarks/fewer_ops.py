"""Fewer operators per layer: each rewrite of the decode step measured on its own, in one run.

The variants (`minillm/course/step_variants.py`) are the same arithmetic in more operators: RoPE by
concatenation, q/k/v by slicing, the KV cache by whole-cache indexing. For each weight format this runs
the step as first written ("before"), with each rewrite alone, and with all of them ("after", the code
as it is), taking turns step by step: the single-stream decode step's median time (the kv stage, at the
prompt's context) and its speed against "after" (the median of step-by-step ratios), the operators Python
calls per step, and whether 32 greedy tokens equal "after"'s. Every setup runs the block as PyTorch operators
(the rewrites are of those; the C block of `minillm/backends/c_block.py` is off).

    python benchmarks/fewer_ops.py [--steps 100] > benchmarks/results/cpu_fewer_ops.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.course.step_variants import VARIANTS, op_counts, textbook
from minillm.generate import generate
from minillm.sampling import SamplingParams

PROMPT = "The history of the printing press begins in"
FORMATS = [("float32", None), ("bfloat16", None), ("float32", "q4_file")]
# name -> the parts still written the old way
sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import decode_step  # noqa: E402  (the same step that step_overhead.py splits)

SETUPS = {"before": VARIANTS, **{f"{v} rewritten": tuple(o for o in VARIANTS if o != v) for v in VARIANTS},
          "after": ()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per setup and format")
    args = ap.parse_args()
    tok = minillm.load_tokenizer()
    ids = tok.encode(PROMPT)
    models = {quant or dtype: minillm.load_model(dtype=dtype, quant=quant) for dtype, quant in FORMATS}
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    results = []
    for f, m in tqdm(models.items(), desc="formats", file=sys.stderr):
        step = decode_step(m, ids)
        ops, tokens, times = {}, {}, {s: [] for s in SETUPS}
        for s, old in SETUPS.items():
            with textbook(*old):
                ops[s] = sum(op_counts(step).values())
                tokens[s] = generate(m, tok, ids, params, stage="kv").token_ids
        for _ in range(args.steps):                      # the setups take turns step by step: drift hits all alike
            for s, old in SETUPS.items():
                with textbook(*old):
                    t0 = time.perf_counter()
                    step()
                    times[s].append(time.perf_counter() - t0)
        after = statistics.median(times["after"])
        for s in SETUPS:
            ratios = [b / a for a, b in zip(times[s], times["after"])]   # this step's speed against "after"'s
            results.append({"format": f, "setup": s, "old_parts": list(SETUPS[s]), "ops_per_step": ops[s],
                            "step_ms": statistics.median(times[s]) * 1e3,
                            "step_ms_quartiles": [q * 1e3 for q in statistics.quantiles(times[s], n=4)],
                            "speed_vs_after": statistics.median(ratios),
                            "after_step_ms": after * 1e3,
                            "same_tokens_as_after": tokens[s] == tokens["after"]})
    print(json.dumps({"machine": machine_info(), **provenance(), "backend": "torch", "prompt_tokens": len(ids), "steps": args.steps,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
