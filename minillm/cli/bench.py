"""`python -m minillm bench [stages|serve]`: stage speeds, or requests through the engine or a server."""
from __future__ import annotations

import json
import sys

from ..backends import report as backend_report
from .common import check_quality, fail, load


def cmd_bench(args) -> None:
    from ..course.bench import load_prompts, load_transformers_peer, prompt_ids, run_bench
    from ..generate import ALL_STAGES

    if args.mode == "serve":
        return cmd_bench_serve(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in ALL_STAGES]
    if not stages or unknown:
        fail(f"unknown stage(s) {unknown or args.stages!r}; choose from: {', '.join(ALL_STAGES)}")
    if args.max_tokens < 2 or args.repeats < 1:
        fail("--max-tokens must be >= 2 and --repeats >= 1")
    prompts = load_prompts(args.prompt_file)
    args.stage = stages[0]
    model, tok, device = load(args, say_backend=not args.json)
    quality = check_quality(args, model, device, [prompt_ids(tok, p) for p in prompts])
    peer = load_transformers_peer(args.model) if args.peer == "transformers" else None
    report = run_bench(model, tok, stages, prompts, max_tokens=args.max_tokens, repeats=args.repeats, peer=peer,
                       kv_cache_dtype=args.kv_cache_dtype)
    report["quality"] = quality
    report["backend"] = backend_report(model)
    if not args.json:
        print(f"{'stage':<12} {'prefill tok/s':>12} {'ttft ms':>9} {'decode tok/s':>13} {'ratio':>6} {'of floor':>9}",
              file=sys.stderr)
        for r in report["results"]:
            floor = f"{r['fraction_of_floor']:.0%}" if "fraction_of_floor" in r else "-"
            print(f"{r['stage']:<12} {r['prefill_tokens_per_s']:>12.1f} {r['ttft_s'] * 1e3:>9.1f} "
                  f"{r['decode_tokens_per_s']:>13.2f} {r['ratio_to_first']:>6.2f} {floor:>9}", file=sys.stderr)
        print(f"bandwidth floor: {report['bandwidth_floor_tokens_per_s']:.1f} tok/s "
              f"({report['weight_bytes'] / 1e6:.0f} MB of weights read at {report['read_bytes_per_s'] / 1e9:.1f} GB/s)",
              file=sys.stderr)
    print(json.dumps(report, indent=None if args.json else 2))


def serve_row(r: dict) -> str:
    hit = r["prefix_cache_hit_rate"]
    return (f"{r['system']:<13} {r['completed']:>5} {r['output_tokens_per_s']:>8.1f} "
            f"{r['ttft_s']['p50'] or 0:>9.2f} {r['ttft_s']['p99'] or 0:>7.2f} {r['itl_s']['p50'] or 0:>8.3f} "
            f"{r['itl_s']['p99'] or 0:>7.3f} {r['e2e_s']['p50'] or 0:>8.2f} {'-' if hit is None else f'{hit:.0%}':>9}")


SERVE_HEADER = (f"{'system':<13} {'done':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
                f"{'e2e p50':>8} {'cache hit':>9}  (seconds)")


def cmd_bench_http(args) -> None:
    from ..course.bench import machine_info
    from ..course.bench_http import load_text_workload, run_http_bench
    from ..course.bench_serve import load_workload, summarize_system

    if args.max_concurrency < 1 or args.timeout <= 0 or args.num_requests < 1:
        fail("--max-concurrency and --num-requests must be >= 1 and --timeout > 0")
    text = args.workload is not None and "prompt_tokens" not in open(args.workload).readline()
    if text:
        items = load_text_workload(args.workload, args.num_requests, args.max_tokens, args.request_rate)
    else:
        items = load_workload(args.workload, args.num_requests, args.length_scale, request_rate=args.request_rate)
    replay = run_http_bench(args.url, items, model=args.served_model_name, chat=args.chat,
                            max_concurrency=args.max_concurrency, ignore_eos=not args.no_ignore_eos,
                            api_key=args.api_key, timeout_s=args.timeout)
    result = summarize_system(args.url, replay)
    if not args.json:
        print(SERVE_HEADER + "\n" + serve_row(result), file=sys.stderr, flush=True)
    workload = {"file": args.workload or "data/request_trace.jsonl", "url": args.url, "num_requests": len(items),
                "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                "max_concurrency": args.max_concurrency, "chat": args.chat, "ignore_eos": not args.no_ignore_eos,
                "mean_output_tokens": sum(w.output_len for w in items) / len(items)}
    print(json.dumps({"machine": machine_info(), "workload": workload, "results": [result]}))


def cmd_bench_serve(args) -> None:
    from ..course.bench import load_prompts, load_transformers_peer, machine_info, prompt_ids, provenance
    from ..course.bench_serve import load_workload, run_serve_bench

    if args.url is not None:
        return cmd_bench_http(args)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in ("continuous", "static") for s in systems):
        fail(f"--systems takes continuous and/or static; got {args.systems!r} (add transformers with --peer)")
    if args.max_concurrency < 1 or args.max_num_batched_tokens < 1 or args.timeout <= 0:
        fail("--max-concurrency and --max-num-batched-tokens must be >= 1 and --timeout > 0")
    items = load_workload(args.workload, args.num_requests, args.length_scale, request_rate=args.request_rate,
                          shared_prefix_tokens=args.shared_prefix_tokens)
    args.stage = "continuous"
    model, tok, device = load(args, say_backend=not args.json)
    quality = check_quality(args, model, device, [prompt_ids(tok, p) for p in load_prompts()])   # text, not the
    # workload's random ids: the bounds are for language
    hf = None
    if args.peer == "transformers":
        hf = load_transformers_peer(args.model)
        systems.append("transformers")

    def show(r):
        if not args.json:
            print(serve_row(r), file=sys.stderr, flush=True)

    if not args.json:
        print(SERVE_HEADER, file=sys.stderr, flush=True)
    results, _ = run_serve_bench(model, tok, items, systems, hf_model=hf, max_concurrency=args.max_concurrency,
                                 engine_options={"max_num_batched_tokens": args.max_num_batched_tokens,
                                                 "enable_prefix_caching": not args.no_prefix_caching,
                                                 "kv_cache_dtype": args.kv_cache_dtype,
                                                 "enforce_eager": args.enforce_eager,
                                                 "attention": args.attention},
                                 timeout_s=args.timeout, on_result=show)
    workload = {"file": args.workload or "data/request_trace.jsonl", "num_requests": len(items),
                "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                "max_concurrency": args.max_concurrency, "length_scale": args.length_scale,
                "mean_prompt_tokens": sum(len(w.prompt_ids) for w in items) / len(items),
                "mean_output_tokens": sum(w.output_len for w in items) / len(items),
                "max_output_tokens": max(w.output_len for w in items),
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "shared_prefix_tokens": args.shared_prefix_tokens, "prefix_caching": not args.no_prefix_caching}
    print(json.dumps({"machine": machine_info(), **provenance(), "workload": workload, "results": results, "quality": quality,
                      "backend": backend_report(model)}))
