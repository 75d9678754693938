"""The engine's step on the thread that loaded the model, and on another thread, taking turns.

    python benchmarks/engine_thread.py [--rounds 5] [--out benchmarks/results/cpu_engine_thread.json]

The model is loaded (dequantized, its weights packed for oneDNN: parallel operators) on the main thread.
Then the same load, 48 chat questions at once answered to their end (greedy, up to 96 tokens), runs through
`LLMEngine` in turns:
  same thread     stepped on the main thread, the one that loaded the model
  other thread    stepped on a new thread, as the server stepped it before it loaded each model in the
                  thread that steps it (`minillm/server/async_engine.py`)
Each thread that runs a parallel operator gets a team of OpenMP threads of its own. With two teams there are
more OpenMP threads than cores, and GNU OpenMP then lets a waiting thread spin only ~100 times before it
sleeps: between two operators the helpers fall asleep, and each operator waits for them to wake. The CPU
time of each thread of the process shows it: with one team the helper is busy as long as the stepping
thread; with two it sleeps through part of the run. Per round: wall time, output tokens/s, and the helper's
CPU time over the stepping thread's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.bench_http import load_text_workload  # noqa: E402


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, from /proc (Linux)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:                      # a thread that ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def answer_all(engine, prompts, tag: str, max_tokens: int) -> int:
    from minillm.sampling import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens


def timed(run) -> dict:
    """run() on this thread: wall time, tokens, and the two busiest threads' CPU time."""
    before, t0 = thread_cpu_s(), time.perf_counter()
    tokens = run()
    wall, after = time.perf_counter() - t0, thread_cpu_s()
    cpu = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return {"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
            "helper_cpu_over_stepping_cpu": cpu[1] / cpu[0] if len(cpu) > 1 and cpu[0] else None}


def on_new_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=fn()))
    t.start()
    t.join()
    return out["r"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_engine_thread.json"))
    args = ap.parse_args()
    from minillm.cli.common import load
    from minillm.cli.parser import build_parser
    from minillm.engine import LLMEngine

    sa = build_parser().parse_args(["serve", "--threads", str(args.threads)])
    sa.stage = "continuous"
    model, tok, where = load(sa, pack_weights=True, say_backend=False)
    engine = LLMEngine(model, tok, max_num_seqs=sa.max_num_seqs, max_num_batched_tokens=sa.max_num_batched_tokens,
                       kv_cache_memory=int(sa.kv_cache_memory * 2**30), max_model_len=sa.max_model_len, verbose=False)
    rows = load_text_workload(ROOT / "data" / "chat_workload.jsonl", args.num_requests, seed=1)
    prompts = [tok.apply_chat_template(r.prompt if isinstance(r.prompt, list) else [{"role": "user", "content": r.prompt}])
               for r in rows]
    answer_all(engine, prompts, "warm", 24)                        # first kernels, before any timing
    runs = {"same thread": [], "other thread": []}
    for rnd in range(args.rounds):
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
        for name in order:
            go = lambda: answer_all(engine, prompts, f"{name}-{rnd}", 96)   # noqa: E731
            r = timed(go) if name == "same thread" else on_new_thread(lambda: timed(go))
            runs[name].append(r)
            print(json.dumps({"round": rnd, "run": name, **{k: round(v, 3) for k, v in r.items() if v is not None}}),
                  flush=True)
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["other thread"], runs["same thread"])]
    summary = {name: {"tok_per_s_median": statistics.median(r["tok_per_s"] for r in rs),
                      "helper_cpu_over_stepping_cpu_median": statistics.median(r["helper_cpu_over_stepping_cpu"]
                                                                               for r in rs)}
               for name, rs in runs.items()}
    summary["other_over_same_wall"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"machine": machine_info() | {"threads": args.threads}, **provenance(), "backend": where,
                                          "workload": {"file": "data/chat_workload.jsonl", "num_requests":
                                                       args.num_requests, "max_tokens": 96, "all_at_once": True},
                                          "rounds": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
