"""What serving adds to the engine's own step: the same questions through `LLMEngine` alone and through
`python -m minillm serve` over HTTP, in one run, taking turns.

    python benchmarks/served_vs_engine.py [--dtypes float32,bfloat16] [--num-requests 48] [--rounds 4]
                                          [--out benchmarks/results/cpu_served_vs_engine.json]

Both sides are built the same way: the engine is `serve`'s own (`cli/serve.build_engine`, its default
options), stepped in this process with nothing else to do; the server is a child process on a loopback
port, the questions sent by `minillm.course.bench_http` with streaming, as `serving.py` sends them. The
load: the chat questions of data/chat_workload.jsonl, all at once, greedy, answers to their natural end
(up to 96 tokens). Times are taken where each side sees a token: at the end of the engine's step, and when
the client reads the chunk. Each side is warmed up first; the rounds alternate (engine first on even
rounds). For each served round the CPU seconds of the server's threads (the engine's thread and its
OpenMP helper, the HTTP thread) and of this process (the client) are recorded too: on a machine with as
many cores as the engine has threads, every core-second another thread takes is one the engine waits for.
The JSON records the machine, the commit, the date and every round.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.bench_http import load_text_workload, run_http_bench  # noqa: E402
from minillm.course.bench_serve import replay_engine, summarize_system  # noqa: E402
from minillm.course.launch_server import ServerProcess  # noqa: E402
from serving import versions  # noqa: E402

WORKLOAD = ROOT / "data" / "chat_workload.jsonl"


def cpu_seconds(server: ServerProcess) -> tuple[dict[int, float], float]:
    """CPU seconds so far of each of the server's threads (by thread id), and of this process."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return ({t.id: t.user_time + t.system_time for t in psutil.Process(server.proc.pid).threads()},
            me.ru_utime + me.ru_stime)


def cpu_split(before, after, server: ServerProcess) -> dict:
    """CPU seconds between two `cpu_seconds`: the server's HTTP thread (the process's first), its other
    threads (the engine's, busiest first), and the client."""
    used = {tid: s - before[0].get(tid, 0.0) for tid, s in after[0].items()}
    http = used.pop(server.proc.pid, 0.0)
    return {"server_http_thread_s": round(http, 3),
            "server_other_threads_s": sorted((round(s, 3) for s in used.values() if s > 0.005), reverse=True),
            "client_s": round(after[1] - before[1], 3)}


def engine_items(tok, n: int, max_tokens: int, seed: int = 1):
    """The workload's questions as token ids, through the chat template the server applies."""
    items = load_text_workload(WORKLOAD, n, max_tokens, seed=seed)
    for w in items:
        w.prompt_ids = tok.apply_chat_template(w.prompt if isinstance(w.prompt, list)
                                               else [{"role": "user", "content": w.prompt}])
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_served_vs_engine.json"))
    args = ap.parse_args()
    from minillm.cli.parser import build_parser
    from minillm.cli.serve import build_engine

    results = []
    for dtype in args.dtypes.split(","):
        serve_args = build_parser().parse_args(["serve", "--threads", str(args.threads), "--dtype", dtype])
        engine, where = build_engine(serve_args, None, None)
        server = ServerProcess.minillm(["--threads", str(args.threads), "--dtype", dtype]).start()
        try:
            for n in (2, args.num_requests):               # warm-up: first kernels, the full batch
                replay_engine(engine, engine_items(engine.tokenizer, n, 24), progress=False, ignore_eos=False)
                run_http_bench(server.url, load_text_workload(WORKLOAD, n, 24), chat=True, ignore_eos=False,
                               progress=False)
            for rnd in range(args.rounds):
                sides = ["engine alone", "served"] if rnd % 2 == 0 else ["served", "engine alone"]
                for side in sides:
                    cpu = {}
                    if side == "served":
                        before = cpu_seconds(server)
                        replay = run_http_bench(server.url, load_text_workload(WORKLOAD, args.num_requests, 96, seed=1),
                                                chat=True, ignore_eos=False, progress=False)
                        cpu = {"cpu": cpu_split(before, cpu_seconds(server), server)}
                    else:
                        replay = replay_engine(engine, engine_items(engine.tokenizer, args.num_requests, 96),
                                               progress=False, ignore_eos=False)
                    r = summarize_system(side, replay) | {"dtype": dtype, "round": rnd, "backend": where} | cpu
                    results.append(r)
                    print(json.dumps({"side": side, "dtype": dtype, "round": rnd, "tok_s": round(r["output_tokens_per_s"], 1),
                                      "ttft_p50": r["ttft_s"]["p50"], "itl_p50": r["itl_s"]["p50"],
                                      "itl_p99": r["itl_s"]["p99"]} | cpu), flush=True)
        finally:
            server.stop()
        del engine
    summary = {}
    for dtype in args.dtypes.split(","):
        med = {side: {k: statistics.median(f(r) for r in results if r["system"] == side and r["dtype"] == dtype)
                      for k, f in (("tok_s", lambda r: r["output_tokens_per_s"]), ("ttft_p50", lambda r: r["ttft_s"]["p50"]),
                                   ("itl_p50", lambda r: r["itl_s"]["p50"]), ("itl_p99", lambda r: r["itl_s"]["p99"]))}
               for side in ("engine alone", "served")}
        summary[dtype] = med
        print(dtype, json.dumps(med))
    Path(args.out).write_text(json.dumps({
        "machine": machine_info() | {"threads": args.threads}, **provenance(), "versions": versions(argparse.Namespace(vllm_python=None, peer_python=None, no_transformers=True)),
        "workload": {"file": "data/chat_workload.jsonl", "num_requests": args.num_requests, "all_at_once": True,
                     "max_tokens": 96, "greedy": True, "ignore_eos": False, "rounds": args.rounds},
        "results": results, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
