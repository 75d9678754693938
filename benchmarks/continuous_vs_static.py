"""Why continuous batching gains less over static batching once the step got faster: the same burst through
both policies, with PyTorch's layers and with the native backend's, and the step-cost curve of each.

    python benchmarks/continuous_vs_static.py [--num-requests 128] [--max-concurrency 64]
                                              [--out benchmarks/results/cpu_continuous_vs_static.json]

For each backend (`torch`: the plain model; `native`: its C loops for a few rows and packed weights above, as
`serve` runs it):
  curve      an engine step's time for 1, 2, 4, ... 64 decoding requests and for a 128- and a 512-token prompt
  predicted  the two policies' schedules (`simulate`) priced step by step from that curve
  measured   the burst itself through `LLMEngine` with each policy (`run_serve_bench`), output tokens/s
Static batching loses time in the steps where a batch has only its longest answers left. What those steps
cost against a full step is the step-cost curve's shape: a flat curve makes them as dear as a full step,
a steep one makes them cheap, and then continuous batching has less to win.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import minillm  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.bench_serve import load_workload, run_serve_bench  # noqa: E402
from minillm.course.simulate import decode_step_times, predicted_seconds, prefill_step_times, simulate  # noqa: E402

DECODE = (1, 2, 4, 8, 16, 32, 64)
PREFILL = (128, 512)


def curve(model, tok) -> dict:
    runs = {b: decode_step_times(model, tok, b) for b in DECODE} | {n: prefill_step_times(model, tok, n) for n in PREFILL}
    tokens = sorted(runs)
    return {"tokens": tokens, "seconds": [statistics.median(runs[t]) for t in tokens],
            "spread_s": [[min(runs[t]), max(runs[t])] for t in tokens]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_continuous_vs_static.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from minillm.backends import apply_backend

    base, tok = minillm.load_model(), minillm.load_tokenizer()
    models = {"torch": base, "native": apply_backend(base, "native", pack_weights=True)}
    items = load_workload(num_requests=args.num_requests)
    p_lens, o_lens = [len(w.prompt_ids) for w in items], [w.output_len for w in items]
    schedules = {p: simulate(p_lens, o_lens, policy=p, max_num_seqs=args.max_concurrency)
                 for p in ("continuous", "static")}
    out = {"machine": machine_info(), **provenance(), "num_requests": args.num_requests,
           "max_concurrency": args.max_concurrency, "output_tokens": sum(o_lens),
           "steps": {p: len(s) for p, s in schedules.items()}, "backends": {}}
    for name, model in models.items():
        c = curve(model, tok)
        predicted = {p: predicted_seconds(s, c["tokens"], c["seconds"]) for p, s in schedules.items()}
        results, _ = run_serve_bench(model, tok, items, max_concurrency=args.max_concurrency, progress=False)
        measured = {r["system"]: r["output_tokens_per_s"] for r in results}
        out["backends"][name] = {"curve": c, "predicted_s": predicted,
                                 "predicted_gain": predicted["static"] / predicted["continuous"],
                                 "measured_tokens_per_s": measured,
                                 "measured_gain": measured["continuous"] / measured["static"], "results": results}
        b = out["backends"][name]
        print(f"{name}: step ms " + ", ".join(f"{t}: {s * 1e3:.0f}" for t, s in zip(c["tokens"], c["seconds"]))
              + f"\n  predicted continuous/static {b['predicted_gain']:.2f}x, measured {b['measured_gain']:.2f}x "
              f"({measured['continuous']:.0f} vs {measured['static']:.0f} tok/s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
