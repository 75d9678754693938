"""`python -m minillm generate | chat | serve | bench | course`.

Bad input (unknown stage, missing model, invalid sampling values, a prompt longer
than the context) ends the command with one line on stderr that says what to
fix, and exit status 2; never a traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _fail(msg: str) -> None:
    print(f"minillm: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _add_model_args(p, stage: bool = True):
    from .generate import ALL_STAGES

    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: the course model)")
    if stage:
        p.add_argument("--stage", default="naive", choices=ALL_STAGES, help="which engine stage generates")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    _add_precision_args(p)


def _add_precision_args(p):
    from . import DTYPES
    from .quant import FORMATS

    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="activations, norms and KV cache (and unquantized weights); default float32")
    p.add_argument("--quant", default=None, choices=list(FORMATS),
                   help="quantized weights: int8 (weight-only), w8a8 (int8 activations too), q4 (4-bit), "
                        "q4_file (the GGUF file's own 4-bit blocks); default: none")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "int4"],
                   help="store the KV cache quantized (stages kv, flash, continuous and the server); default: --dtype")


def _add_sampling_args(p, max_tokens=128):
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop at this text (repeatable)")
    p.add_argument("--seed", type=int, default=None)


def _add_speculative_args(p):
    p.add_argument("--speculative", default=None, metavar="ngram|layers:N",
                   help="speculative decoding (stages kv, flash, paged, continuous): n-gram prompt lookup, "
                        "or the model's first N layers as the draft")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafts per step (default 4)")


def _check_speculative(args) -> None:
    if args.speculative is None:
        return
    from .speculative import make_proposer

    try:
        make_proposer(args.speculative)
    except ValueError as e:
        _fail(str(e))
    if args.stage == "naive":
        _fail("--speculative needs a stage with a KV cache to roll back: kv, flash, paged or continuous")
    if args.num_speculative_tokens < 1:
        _fail(f"--num-speculative-tokens must be >= 1; got {args.num_speculative_tokens}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minillm", description="minillm: a small LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_speculative_args(g)
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the model across N processes of this machine (torch.distributed, gloo; the kv "
                        "stage, or the engine with --stage continuous; float32); N must divide the heads: 1 or 3 "
                        "for SmolLM2. Spawns the ranks itself, or is one of them under torchrun --nproc-per-node N. "
                        "Prints the answer at the end")

    c = sub.add_parser("chat", help="chat in the terminal (/reset clears, /exit or Ctrl-D quits)")
    c.add_argument("--system", default=None, help="a system message")
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=256)
    _add_speculative_args(c)

    se = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    se.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    se.add_argument("--port", type=int, default=8000)
    se.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    se.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: the model's)")
    se.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step at most (default 64)")
    se.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step at most (default 512)")
    se.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB", help="KV cache size (default 1 GiB)")
    se.add_argument("--max-model-len", type=int, default=None, help="context per request (default: the model's)")
    se.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    se.add_argument("--max-queued-requests", type=int, default=None,
                    help="answer 503 when this many requests are already waiting (default: no limit)")
    se.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="seconds running answers get to finish on shutdown (default 30)")
    _add_model_args(se, stage=False)
    _add_speculative_args(se)

    co = sub.add_parser("course", help="open the course notebooks in JupyterLab")
    co.add_argument("--port", type=int, default=None)
    co.add_argument("--dry-run", action="store_true", help="print the command instead of running it")

    b = sub.add_parser("bench", help="stages: prefill and decode speed per stage on a prompt set; "
                                     "serve: requests arriving over time through the serving engine")
    b.add_argument("mode", nargs="?", choices=["stages", "serve"], default="stages",
                   help="stages (default) or serve")
    b.add_argument("--peer", choices=["transformers"], default=None,
                   help="also measure Hugging Face transformers on the same GGUF, in the same run")
    b.add_argument("--json", action="store_true", help="print only the JSON (default: JSON plus a table)")
    st = b.add_argument_group("bench stages")
    st.add_argument("--stages", default="naive", help="comma-separated stages, measured alternately")
    st.add_argument("--max-tokens", type=int, default=64)
    st.add_argument("--prompt-file", default=None, help=".jsonl ({'prompt', 'chat'}) or .txt (one per line)")
    st.add_argument("--repeats", type=int, default=1)
    sv = b.add_argument_group("bench serve")
    sv.add_argument("--num-requests", type=int, default=128)
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (default inf: all at once)")
    sv.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (and batch size)")
    sv.add_argument("--workload", default=None, help="a .jsonl trace with prompt_tokens and output_tokens per line "
                                                     "(default: data/request_trace.jsonl)")
    sv.add_argument("--length-scale", type=float, default=0.6, help="multiply the trace's lengths (default 0.6)")
    sv.add_argument("--systems", default="continuous,static", help="engine policies to run (continuous,static)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    sv.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="every prompt starts with the same N tokens (a shared system prompt)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix cache off")
    sv.add_argument("--timeout", type=float, default=1800.0, help="seconds per system before giving up")
    sv.add_argument("--url", default=None, help="load-test a running OpenAI-compatible server at this address "
                                                "instead of the engine in this process")
    sv.add_argument("--chat", action="store_true", help="with --url: send /v1/chat/completions (default: completions)")
    sv.add_argument("--served-model-name", default=None, help="with --url: the 'model' to send (default: the "
                                                               "server's first in /v1/models)")
    sv.add_argument("--api-key", default=None, help="with --url: sent as a Bearer token")
    sv.add_argument("--no-ignore-eos", action="store_true",
                    help="with --url: do not send ignore_eos (for servers without it; outputs may end early)")
    b.add_argument("--model", default=None)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--device", default=None)
    _add_precision_args(b)
    return parser


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed)


def _load(args):
    from . import load_model, load_tokenizer

    if args.threads is not None:
        if args.threads < 1:
            _fail(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        _fail(f"--device {device} asked for, but this torch build sees no GPU; use --device cpu")
    tok = load_tokenizer(args.model)
    try:
        model = load_model(args.model, device=device, dtype=args.dtype, quant=args.quant,
                           kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as e:   # e.g. q4_file with a model that is not a Q4_1 GGUF file
        _fail(str(e))
    return model, tok, device


def _check_quality(args, model, device, prompts: list[list[int]]) -> dict | None:
    """A lossy precision (quantized weights, half-precision floats, a quantized KV cache) gets its speed
    measured only where it computes what float32 does: its mean KL from float32 on the run's own prompts
    within its bound (`quant/quality.py`). Past it, the run ends saying so."""
    from . import load_model
    from .quant.quality import check_quality, kl_bound, refusal

    if kl_bound(model) is None:
        return None
    q = check_quality(model, load_model(args.model, device=device), prompts)
    if not q["within_bound"]:
        _fail(refusal(q))
    if not args.json:
        print(f"{q['format']}: mean KL {q['kl']:.4f} from float32 on these prompts ({q['tokens']} tokens; "
              f"bound {q['bound']:g})", file=sys.stderr)
    return q


def cmd_generate(args) -> None:
    from .generate import Generation, check_prompt, stream

    params = _sampling(args)
    _check_speculative(args)
    if args.tensor_parallel is not None:
        return _generate_tensor_parallel(args, params)
    model, tok, device = _load(args)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    check_prompt(ids, model.cfg.max_seq_len)
    result = Generation(prompt_tokens=len(ids))
    try:
        for piece in stream(model, tok, ids, params, args.stage, result=result, speculative=args.speculative,
                            num_speculative_tokens=args.num_speculative_tokens):
            if not args.json:
                print(piece, end="", flush=True)
    except ValueError as e:          # e.g. a draft with more layers than the model has
        _fail(str(e))
    spec = {}
    if args.speculative is not None:
        spec = {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
                "acceptance_rate": result.acceptance_rate, "mean_accepted_tokens": result.mean_accepted_tokens,
                "spec_drafts": result.spec_drafts, "spec_draft_tokens": result.spec_draft_tokens,
                "spec_accepted_tokens": result.spec_accepted_tokens}
    if args.json:
        print(json.dumps({
            "prompt_tokens": result.prompt_tokens, "token_ids": result.token_ids, "text": result.text,
            "ttft_s": result.ttft_s, "decode_tokens_per_s": result.decode_tokens_per_s,
            "prefill_tokens_per_s": result.prefill_tokens_per_s, "finish_reason": result.finish_reason,
            "stage": result.stage, "device": device, "model": model.cfg.name, **spec,
        }))
    else:
        print()
        extra = (f"; {args.speculative} k={args.num_speculative_tokens}: {result.acceptance_rate:.0%} of drafts "
                 f"accepted, {result.mean_accepted_tokens:.2f} per pass" if spec else "")
        print(f"[{len(result.token_ids)} tokens, {result.finish_reason}; ttft {result.ttft_s * 1e3:.0f} ms, "
              f"decode {result.decode_tokens_per_s:.1f} tok/s, stage {result.stage}, {device}{extra}]", file=sys.stderr)


def _generate_tensor_parallel(args, params) -> None:
    """Spawn the ranks here, or, started by torchrun (WORLD_SIZE set), be one of them."""
    from . import ModelConfig, load_tokenizer
    from .distributed import check_tensor_parallel, launch
    from .generate import check_prompt

    others = {"--quant": args.quant, "--speculative": args.speculative, "--kv-cache-dtype": args.kv_cache_dtype,
              "--device": args.device}
    given = [flag for flag, value in others.items() if value is not None]
    if given or args.dtype != "float32":
        _fail(f"--tensor-parallel runs the kv stage in float32 on this machine's CPU; drop {', '.join(given) or '--dtype'}")
    if args.stage not in ("naive", "kv", "continuous"):
        _fail(f"--tensor-parallel runs the kv stage (the default) or the engine (--stage continuous); "
              f"drop --stage {args.stage}")
    engine = args.stage == "continuous"
    check_tensor_parallel(ModelConfig(), args.tensor_parallel)
    torchrun = "WORLD_SIZE" in os.environ
    if torchrun and int(os.environ["WORLD_SIZE"]) != args.tensor_parallel:
        _fail(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tensor-parallel is {args.tensor_parallel}; "
              f"give torchrun --nproc-per-node {args.tensor_parallel}")
    rank_fn = launch.tensor_parallel_engine_rank if engine else launch.tensor_parallel_rank
    extra = ({"max_num_seqs": 1},) if engine else ()                 # the engine's options
    if torchrun and int(os.environ.get("RANK", 0)) != 0:             # a follower: no tokenizer, no output
        rank, world = launch.init_from_env()
        rank_fn(rank, world, None, params, *extra, args.model)
        launch.leave()
        return
    tok = load_tokenizer(args.model)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    check_prompt(ids, ModelConfig().max_seq_len)
    if torchrun:
        out = rank_fn(*launch.init_from_env(), [ids] if engine else ids, params, *extra, args.model)
        launch.leave()
    elif engine:
        out = launch.tensor_parallel_engine_generate([ids], params, args.tensor_parallel, *extra, path=args.model)
    else:
        out = launch.tensor_parallel_generate(ids, params, args.tensor_parallel, path=args.model)
    out = out[0] if engine else out
    how = "torchrun" if torchrun else "spawned here"
    if args.json:
        print(json.dumps({"prompt_tokens": len(ids), "token_ids": out["token_ids"], "text": out["text"],
                          "tensor_parallel": args.tensor_parallel, "stage": "continuous" if engine else "kv"}))
    else:
        print(out["text"])
        rate = "" if engine else f", decode {out['decode_tokens_per_s']:.1f} tok/s"
        print(f"[{len(out['token_ids'])} tokens; {'the engine' if engine else 'kv stage'} split across "
              f"{args.tensor_parallel} processes ({how}){rate}]", file=sys.stderr)


def cmd_chat(args) -> None:
    from .generate import stream

    params = _sampling(args)
    _check_speculative(args)
    model, tok, device = _load(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    print(f"minillm chat ({model.cfg.name}, stage {args.stage}, {device}). /reset clears, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = list(base)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(messages)
        if len(ids) >= model.cfg.max_seq_len:
            print(f"[the conversation is {len(ids)} tokens, over the context of {model.cfg.max_seq_len}: /reset]",
                  file=sys.stderr)
            messages.pop()
            continue
        print("bot> ", end="", flush=True)
        reply = []
        try:
            for piece in stream(model, tok, ids, params, args.stage, speculative=args.speculative,
                                num_speculative_tokens=args.num_speculative_tokens):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_bench(args) -> None:
    from .bench import load_prompts, load_transformers_peer, prompt_ids, run_bench
    from .generate import ALL_STAGES

    if args.mode == "serve":
        return cmd_bench_serve(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in ALL_STAGES]
    if not stages or unknown:
        _fail(f"unknown stage(s) {unknown or args.stages!r}; choose from: {', '.join(ALL_STAGES)}")
    if args.max_tokens < 2 or args.repeats < 1:
        _fail("--max-tokens must be >= 2 and --repeats >= 1")
    prompts = load_prompts(args.prompt_file)
    args.stage = stages[0]
    model, tok, device = _load(args)
    quality = _check_quality(args, model, device, [prompt_ids(tok, p) for p in prompts])
    peer = load_transformers_peer(args.model) if args.peer == "transformers" else None
    report = run_bench(model, tok, stages, prompts, max_tokens=args.max_tokens, repeats=args.repeats, peer=peer)
    report["quality"] = quality
    if not args.json:
        print(f"{'stage':<12} {'prefill tok/s':>12} {'ttft ms':>9} {'decode tok/s':>13} {'ratio':>6}", file=sys.stderr)
        for r in report["results"]:
            print(f"{r['stage']:<12} {r['prefill_tokens_per_s']:>12.1f} {r['ttft_s'] * 1e3:>9.1f} "
                  f"{r['decode_tokens_per_s']:>13.2f} {r['ratio_to_first']:>6.2f}", file=sys.stderr)
        print(f"bandwidth floor: {report['bandwidth_floor_tokens_per_s']:.1f} tok/s "
              f"({report['weight_bytes'] / 1e6:.0f} MB of weights at {report['copy_bytes_per_s'] / 1e9:.1f} GB/s copy)",
              file=sys.stderr)
    print(json.dumps(report, indent=None if args.json else 2))


def _serve_row(r: dict) -> str:
    hit = r["prefix_cache_hit_rate"]
    return (f"{r['system']:<13} {r['completed']:>5} {r['output_tokens_per_s']:>8.1f} "
            f"{r['ttft_s']['p50'] or 0:>9.2f} {r['ttft_s']['p99'] or 0:>7.2f} {r['itl_s']['p50'] or 0:>8.3f} "
            f"{r['itl_s']['p99'] or 0:>7.3f} {r['e2e_s']['p50'] or 0:>8.2f} {'-' if hit is None else f'{hit:.0%}':>9}")


SERVE_HEADER = (f"{'system':<13} {'done':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
                f"{'e2e p50':>8} {'cache hit':>9}  (seconds)")


def cmd_serve(args) -> None:
    from .engine import LLMEngine
    from .server import serve

    args.stage = "continuous"
    _check_speculative(args)
    if args.port < 0 or args.port > 65535 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1 or \
            args.kv_cache_memory <= 0 or (args.max_queued_requests is not None and args.max_queued_requests < 1):
        _fail("--port must be in [0, 65535]; --max-num-seqs, --max-num-batched-tokens and --max-queued-requests "
              ">= 1; --kv-cache-memory > 0")
    model, tok, device = _load(args)
    engine = LLMEngine(model, tok, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=int(args.kv_cache_memory * 2**30), max_model_len=args.max_model_len,
                       enable_prefix_caching=not args.no_prefix_caching, speculative=args.speculative,
                       num_speculative_tokens=args.num_speculative_tokens)
    name = args.served_model_name or model.cfg.name
    print(f"minillm: serving {name} on http://{args.host}:{args.port}/v1 ({device})", file=sys.stderr, flush=True)
    serve(engine, name, args.host, args.port, args.api_key, args.max_queued_requests, args.graceful_timeout)


def cmd_bench_http(args) -> None:
    from .bench import machine_info
    from .bench_http import load_text_workload, run_http_bench
    from .bench_serve import load_workload, summarize_system

    if args.max_concurrency < 1 or args.timeout <= 0 or args.num_requests < 1:
        _fail("--max-concurrency and --num-requests must be >= 1 and --timeout > 0")
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
        print(SERVE_HEADER + "\n" + _serve_row(result), file=sys.stderr, flush=True)
    workload = {"file": args.workload or "data/request_trace.jsonl", "url": args.url, "num_requests": len(items),
                "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                "max_concurrency": args.max_concurrency, "chat": args.chat, "ignore_eos": not args.no_ignore_eos,
                "mean_output_tokens": sum(w.output_len for w in items) / len(items)}
    print(json.dumps({"machine": machine_info(), "workload": workload, "results": [result]}))


def cmd_bench_serve(args) -> None:
    from .bench import load_prompts, load_transformers_peer, machine_info, prompt_ids
    from .bench_serve import load_workload, run_serve_bench

    if args.url is not None:
        return cmd_bench_http(args)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in ("continuous", "static") for s in systems):
        _fail(f"--systems takes continuous and/or static; got {args.systems!r} (add transformers with --peer)")
    if args.max_concurrency < 1 or args.max_num_batched_tokens < 1 or args.timeout <= 0:
        _fail("--max-concurrency and --max-num-batched-tokens must be >= 1 and --timeout > 0")
    items = load_workload(args.workload, args.num_requests, args.length_scale, request_rate=args.request_rate,
                          shared_prefix_tokens=args.shared_prefix_tokens)
    args.stage = "continuous"
    model, tok, device = _load(args)
    quality = _check_quality(args, model, device, [prompt_ids(tok, p) for p in load_prompts()])   # text, not the
    # workload's random ids: the bounds are for language
    hf = None
    if args.peer == "transformers":
        hf = load_transformers_peer(args.model)
        systems.append("transformers")

    def show(r):
        if not args.json:
            print(_serve_row(r), file=sys.stderr, flush=True)

    if not args.json:
        print(SERVE_HEADER, file=sys.stderr, flush=True)
    results, _ = run_serve_bench(model, tok, items, systems, hf_model=hf, max_concurrency=args.max_concurrency,
                                 engine_options={"max_num_batched_tokens": args.max_num_batched_tokens,
                                                 "enable_prefix_caching": not args.no_prefix_caching},
                                 timeout_s=args.timeout, on_result=show)
    workload = {"file": args.workload or "data/request_trace.jsonl", "num_requests": len(items),
                "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                "max_concurrency": args.max_concurrency, "length_scale": args.length_scale,
                "mean_prompt_tokens": sum(len(w.prompt_ids) for w in items) / len(items),
                "mean_output_tokens": sum(w.output_len for w in items) / len(items),
                "max_output_tokens": max(w.output_len for w in items),
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "shared_prefix_tokens": args.shared_prefix_tokens, "prefix_caching": not args.no_prefix_caching}
    print(json.dumps({"machine": machine_info(), "workload": workload, "results": results, "quality": quality}))


def cmd_course(args) -> None:
    """JupyterLab on notebooks/ (as root, as on course machines, jupyter wants --allow-root)."""
    import os
    from pathlib import Path

    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    if not notebooks.is_dir():
        _fail(f"no notebooks/ beside the package at {notebooks.parent}; install from a clone: pip install -e .")
    cmd = [sys.executable, "-m", "jupyter", "lab", str(notebooks)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    if args.port:
        cmd.append(f"--port={args.port}")
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")       # a remote or headless machine: open the printed URL (README: SSH tunnel)
    if args.dry_run:
        print(" ".join(cmd))
        return
    os.execv(sys.executable, cmd)


def _log_to_stderr() -> None:
    """The engine reports what it sets up (KV cache size, tokens that fit) at INFO level: on stderr,
    unless logging is configured already."""
    log = logging.getLogger("minillm")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("minillm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv=None) -> None:
    import os

    from .triton_support import TritonUnavailable
    from .weights import ModelNotFoundError

    if not torch.cuda.is_available():  # Triton kernels (stage flash) run through the interpreter on CPU;
        os.environ.setdefault("TRITON_INTERPRET", "1")  # it must be on before anything imports triton

    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "course": cmd_course,
         "serve": cmd_serve}[args.command](args)
    except (ValueError, ModelNotFoundError, TritonUnavailable) as e:
        _fail(str(e))
    except BrokenPipeError:
        sys.stderr.close()
