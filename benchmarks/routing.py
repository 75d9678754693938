"""Model routing on this machine: a quantized copy answers (the 4-bit one by default), the float32 model only when
the answer looks unsure.

    python benchmarks/routing.py [--max-tokens 48] [--repeats 2] [--out benchmarks/results/cpu_routing.json]

For every prompt of data/routing_prompts.jsonl and data/speculative_tasks.jsonl (short questions, chat,
summaries, code edits, extraction), greedy, one request at a time: the cheap model's answer (with the
log-probabilities the router reads) and the exact model's, alternated `repeats` times (median seconds).
Per prompt it records each confidence signal (minillm/routing.py), whether the cheap answer is the exact
one (same tokens), and how far they agree. Then, per signal: how well it predicts agreement (AUC), and
the trade-off as the threshold moves from never to always escalating: share escalated, time against
sending everything to the exact model, agreement with the exact model's answers. Writes the JSON and a plot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import minillm
from minillm import LLM
from minillm.course.bench import machine_info, provenance
from minillm.course.routing_costs import auc, tradeoff
from minillm.routing import SIGNALS, TOP_LOGPROBS, confidence
from minillm.sampling import SamplingParams
from minillm.speculative import quantized_copy

DATA = Path(__file__).parents[1] / "data"


def prompts_of(tok) -> list[dict]:
    rows = [{"task": "question", "prompt": json.loads(line)["prompt"]} for line in open(DATA / "routing_prompts.jsonl")]
    rows += [{"task": t["task"], "prompt": t["prompt"]} for t in map(json.loads, open(DATA / "speculative_tasks.jsonl"))]
    for r in rows:
        r["ids"] = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}])
    return rows


def timed(llm, ids, params) -> tuple[float, object]:
    t0 = time.perf_counter()
    [out] = llm.generate([ids], params, use_tqdm=False)
    return time.perf_counter() - t0, out


def run(cheap_fmt: str, max_tokens: int, repeats: int) -> dict:
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    llms = {"cheap": LLM(quantized_copy(model, cheap_fmt), tok, max_num_seqs=1, verbose=False),
            "exact": LLM(model, tok, max_num_seqs=1, verbose=False)}
    params = {"cheap": SamplingParams(max_tokens=max_tokens, logprobs=TOP_LOGPROBS),
              "exact": SamplingParams(max_tokens=max_tokens)}
    prompts = prompts_of(tok)
    for name, llm in llms.items():                                   # warm-up, not timed
        timed(llm, prompts[0]["ids"], params[name])
    rows = []
    for p in tqdm(prompts, desc="routing"):
        times: dict[str, list[float]] = {"cheap": [], "exact": []}
        outs = {}
        for _ in range(repeats):                                     # alternate: a slow moment hits both
            for name in ("cheap", "exact"):
                s, outs[name] = timed(llms[name], p["ids"], params[name])
                times[name].append(s)
        a, b = outs["cheap"].token_ids, outs["exact"].token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"task": p["task"], "prompt": p["prompt"][:80], "cheap_tokens": len(a), "exact_tokens": len(b),
                     "agrees": a == b, "prefix_agreement": same / max(len(b), 1),
                     "cheap_s": statistics.median(times["cheap"]), "exact_s": statistics.median(times["exact"]),
                     **{s: confidence(outs["cheap"].logprobs, s) for s in SIGNALS}})
    info = machine_info()
    return {"machine": info["cpu"], **provenance(), "threads": info["threads"], "torch": info["torch"], "cheap": cheap_fmt,
            "exact": "float32", "max_tokens": max_tokens, "repeats": repeats, "rows": rows,
            "agreement_without_routing": sum(r["agrees"] for r in rows) / len(rows),
            "cheap_cost": sum(r["cheap_s"] for r in rows) / sum(r["exact_s"] for r in rows),
            "auc": {s: auc([r[s] for r in rows], [r["agrees"] for r in rows]) for s in SIGNALS},
            "tradeoff": {s: tradeoff(rows, s) for s in SIGNALS}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for s in SIGNALS:
        pts = result["tradeoff"][s]
        ax.plot([p["relative_cost"] for p in pts], [p["agreement"] for p in pts], marker=".",
                label=f"{s} (AUC {result['auc'][s]:.2f})")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.text(1.0, 0.02, " everything to the exact model", color="grey", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set(xlabel="time relative to sending every request to the exact model",
           ylabel="answers equal to the exact model's", ylim=(0, 1.02),
           title=f"Routing {result['cheap']} -> float32 as the threshold moves\n{result['machine']}")
    ax.legend(title="confidence signal", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cheap", default="q4", help="the cheap model: the course model quantized so (default q4)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_routing.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.cheap, args.max_tokens, args.repeats)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"{result['machine']}, {result['threads']} threads: the {args.cheap} copy costs {result['cheap_cost']:.2f} of "
          f"float32 and gives the same answer for {result['agreement_without_routing']:.0%} of {len(result['rows'])} prompts")
    for s in SIGNALS:
        best = min((p for p in result["tradeoff"][s] if p["agreement"] >= 0.9), key=lambda p: p["relative_cost"])
        print(f"{s:8s} AUC {result['auc'][s]:.2f}; 90% agreement at {best['relative_cost']:.2f} of the cost, "
              f"{best['escalated']:.0%} escalated (threshold {best['threshold']})")


if __name__ == "__main__":
    main()
