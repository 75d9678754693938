"""Disaggregated prefill/decode against one engine doing both, on this machine's two cores.

The workload where disaggregation should pay: short prompts decoding (they want a steady inter-token
latency) while long prompts arrive (their prefill chunks make every decode step of the one engine
longer). All requests arrive at once. Variants, alternated so the machine's drift hits each alike:

    colocated       one engine, 1 process with 2 torch threads (chunked prefill mixes into decode steps)
    disaggregated   a prefill worker and a decode worker, 1 process with 1 thread each, the prompt's
                    KV cache moved over torch.distributed (gloo, loopback)

    python benchmarks/disaggregation.py       # writes benchmarks/results/cpu_disaggregation.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minillm  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.disaggregation import colocated_run  # noqa: E402
from minillm.distributed.disaggregated import disaggregated_run  # noqa: E402
from minillm.course.timing import percentile# noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

SHORT, LONG, N_SHORT, N_LONG, MAX_TOKENS = 40, 1000, 4, 4, 48
OPTIONS = {"kv_cache_memory": 256 << 20, "max_num_batched_tokens": 512}


def workload() -> list[list[int]]:
    """N_SHORT short prompts first (decoding while the long ones arrive), then N_LONG long ones; seeded
    random token ids, all different, so no prompt is served from the prefix cache."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1000, 20000, (n,), generator=g).tolist() for n in [SHORT] * N_SHORT + [LONG] * N_LONG]


def summary(run: dict) -> dict:
    reqs = run["requests"]
    short, long = reqs[:N_SHORT], reqs[N_SHORT:]
    itl_short = [x for r in short for x in r["itl_s"]]
    return {"ttft_short_median_s": statistics.median(r["ttft_s"] for r in short),
            "ttft_long_median_s": statistics.median(r["ttft_s"] for r in long),
            "itl_short_median_s": statistics.median(itl_short), "itl_short_p99_s": percentile(itl_short, 99),
            "itl_short_max_s": max(itl_short),
            "itl_all_median_s": statistics.median(x for r in reqs for x in r["itl_s"]),
            "total_s": max(r["e2e_s"] for r in reqs)}


def main() -> None:
    prompts = workload()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    runs = {"colocated": [], "disaggregated": []}
    for _ in range(2):
        for name in runs:
            run = (colocated_run(prompts, params, OPTIONS, threads=2, model=model, tokenizer=tok) if name == "colocated"
                   else disaggregated_run(prompts, params, OPTIONS, timeout_s=600))
            run["summary"] = summary(run)
            runs[name].append(run)
            s = run["summary"]
            print(f"{name:14s} TTFT short {s['ttft_short_median_s'] * 1e3:6.0f} ms  long {s['ttft_long_median_s'] * 1e3:6.0f} ms"
                  f"   ITL short median {s['itl_short_median_s'] * 1e3:5.0f} ms  p99 {s['itl_short_p99_s'] * 1e3:5.0f} ms"
                  f"   all done {s['total_s']:.1f} s")
    same = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs["colocated"][0]["requests"],
                                                                 runs["disaggregated"][0]["requests"]))
    print("same tokens in both:", same)
    moved = runs["disaggregated"][-1]["requests"]
    result = {"machine": machine_info(), **provenance(), "workload": {"short_prompt": SHORT, "long_prompt": LONG, "n_short": N_SHORT,
                                                      "n_long": N_LONG, "max_tokens": MAX_TOKENS, **OPTIONS},
              "same_tokens": same,
              "transfers": [{k: r[k] for k in ("blocks", "bytes", "seconds")} for r in moved],
              "runs": runs,
              "note": "colocated: 1 process, 2 torch threads; disaggregated: 2 processes, 1 thread each; "
                      "all requests arrive at t=0; gloo over loopback TCP"}
    path = Path(__file__).resolve().parent / "results" / "cpu_disaggregation.json"
    path.write_text(json.dumps(result) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
