"""The 8-bit output head with and without its top logits recomputed in float32: quality and cost.

    python benchmarks/int8_head.py [--rounds 7] [--out benchmarks/results/cpu_int8_head.json]

Every quantized format keeps the output head in int8 (`quant/apply.py`). Where its kernel returns bfloat16
logits (8 bits: two logits of 20 closer than 0.08 tie), `Int8Linear.rescore` recomputes each row's top
few in float32 from the int8 rows. This measures, in one process:
  quality   mean KL and top-1 agreement with float32 on the held-out text, for `int8` and `q4_file`, with
            rescore_top 0 (off), 2, 4, 8 and a head multiplied in float32 throughout (the ceiling)
  cost      the head's time for 1, 8, 48 and 128 rows with and without rescoring, taking turns, beside a
            forward pass over the same rows (one token each, no cache: a decode step's products without
            its attention), on the plain model and with the native backend that `serve` uses
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import minillm  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.quality import compare, heldout_ids, next_token_logprobs  # noqa: E402
from minillm.quant.apply import RESCORE_TOP, quantize_model  # noqa: E402

ROWS = (1, 8, 48, 128)


def quality(ref, ids, fmt: str) -> dict:
    model = quantize_model(minillm.load_model(), fmt, progress=False)
    head, out = model.lm_head, {}
    for k in (0, 2, 4, 8):
        head.rescore_top = k
        out[f"rescore {k}" if k else "bfloat16 logits"] = compare(ref, next_token_logprobs(model, ids), ids)
    head.rescore_top = 0
    head.forward = lambda x: F.linear(x.float(), head.dequantize(torch.float32))   # the ceiling
    out["float32 head"] = compare(ref, next_token_logprobs(model, ids), ids)
    for name, q in out.items():
        print(f"{fmt:8s} {name:16s} KL {q['kl']:.5f}  top-1 {q['top1']:.4f}", flush=True)
    return out


def timings(model, rounds: int) -> list[dict]:
    """Per row count: the head without and with rescoring, and a forward over the rows, in turns."""
    head, d = model.lm_head, model.cfg.d_model
    rows_out = []
    for rows in ROWS:
        g = torch.Generator().manual_seed(rows)
        h = torch.randn(rows, d, generator=g)                        # (rows, d): the final norm's output
        ids = torch.randint(0, model.cfg.vocab_size, (rows, 1), generator=g)

        def head_with(k):
            def run():
                head.rescore_top = k
                head(h)
            return run

        def forward():
            head.rescore_top = RESCORE_TOP
            model(ids)                                               # (rows, 1, vocab)

        runs = {"head": head_with(0), "head + rescore": head_with(RESCORE_TOP), "forward": forward}
        times: dict[str, list[float]] = {n: [] for n in runs}
        with torch.inference_mode():
            for r in range(rounds + 1):                              # round 0 warms up
                for name, run in (runs.items() if r % 2 else reversed(runs.items())):
                    t0 = time.perf_counter()
                    run()
                    if r:
                        times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        row = {"rows": rows, "ms": med, "spread_ms": {n: [min(t) * 1e3, max(t) * 1e3] for n, t in times.items()},
               "rescore_ms_per_row": (med["head + rescore"] - med["head"]) / rows,
               "rescore_share_of_forward": (med["head + rescore"] - med["head"]) / med["forward"]}
        rows_out.append(row)
        print(f"{rows:4d} rows  head {med['head']:7.2f} ms  + rescore {med['head + rescore']:7.2f} ms  "
              f"forward {med['forward']:7.2f} ms  rescore/forward {row['rescore_share_of_forward']:+.1%}", flush=True)
    head.rescore_top = RESCORE_TOP
    return rows_out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_int8_head.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from minillm.backends import apply_backend

    tok = minillm.load_tokenizer()
    ids = heldout_ids(tok)
    ref = next_token_logprobs(minillm.load_model(), ids)
    result = {"machine": machine_info(), **provenance(),
              "heldout_tokens": len(ids), "rescore_top": RESCORE_TOP,
              "quality": {fmt: quality(ref, ids, fmt) for fmt in ("int8", "q4_file")}, "cost": {}}
    model = quantize_model(minillm.load_model(), "int8", progress=False)
    result["cost"]["torch"] = timings(model, args.rounds)
    model = apply_backend(model, "native")
    print("native backend (the C loop takes the head's first rows, in float32: nothing to rescore there)")
    result["cost"]["native"] = timings(model, args.rounds)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
