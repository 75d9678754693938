"""`python -m minillm serve`: the OpenAI-compatible server (one model, or several and a router)."""
from __future__ import annotations

import re
import sys
from argparse import Namespace

from .common import check_speculative, fail, load


def parse_models(values: list[str] | None, served_name: str | None) -> list[tuple[str | None, str | None, str | None]]:
    """--model values -> [(name, path, quant)]: one PATH (the name is --served-model-name or the model's),
    or NAME=PATH[:quant=FMT] for each of several models (PATH empty: the course model)."""
    if not values or (len(values) == 1 and "=" not in values[0]):
        return [(served_name, values[0] if values else None, None)]
    if served_name:
        fail("--served-model-name names a single model: with several, name each as --model NAME=PATH")
    models = []
    for v in values:
        name, eq, rest = v.partition("=")
        if not eq or not name:
            fail(f"--model {v!r}: with several models, give each as NAME=PATH[:quant=FMT]")
        path, *opts = re.split(r":(?=quant=)", rest)
        quant = None
        for opt in opts:
            quant = opt.removeprefix("quant=")
        models.append((name, path or None, quant))
    names = [m[0] for m in models]
    if len(set(names)) != len(names) or "auto" in names:
        fail(f"each --model needs a name of its own, and not 'auto' (the router's); got {', '.join(names)}")
    return models


def cmd_serve(args) -> None:
    from ..routing import RoutePolicy
    from ..server import serve
    from ..server.async_engine import engine_thread

    args.stage = "continuous"
    check_speculative(args)
    if args.port < 0 or args.port > 65535 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1 or \
            args.kv_cache_memory <= 0 or (args.max_queued_requests is not None and args.max_queued_requests < 1) or \
            args.max_tokens_default < 1:
        fail("--port must be in [0, 65535]; --max-num-seqs, --max-num-batched-tokens, --max-queued-requests and "
             "--max-tokens-default >= 1; --kv-cache-memory > 0")
    models = parse_models(args.model, args.served_model_name)
    if args.route_threshold is not None and len(models) < 2:
        fail("--route-threshold routes between two models: give two --model NAME=PATH (the cheap one first)")
    engines, threads, where = {}, {}, None
    for name, path, quant in models:
        # each model is loaded in the thread that will step it (async_engine.py says why)
        thread = engine_thread()
        engine, where = thread.submit(build_engine, args, path, quant).result()
        engines[name or engine.model.cfg.name] = engine
        threads[name or engine.model.cfg.name] = thread
    names = list(engines)
    route = None
    if args.route_threshold is not None:
        try:
            route = RoutePolicy(names[0], names[-1], args.route_threshold, args.route_signal)
        except ValueError as e:
            fail(str(e))
    served = ", ".join(names + (["auto"] if route else []))
    print(f"minillm: serving {served} on http://{args.host}:{args.port}/v1 ({where})", file=sys.stderr, flush=True)
    serve(engines, None, args.host, args.port, args.api_key, args.max_queued_requests, args.graceful_timeout,
          max_tokens_default=args.max_tokens_default, route=route, engine_threads=threads)


def build_engine(args, path: str | None, quant: str | None):
    """One served model: (its LLMEngine, where it runs)."""
    from ..engine import LLMEngine

    model, tok, where = load(Namespace(**{**vars(args), "model": path, "quant": quant or args.quant}),
                             pack_weights=not args.no_pack_weights, say_backend=True)
    try:
        return LLMEngine(
            model, tok, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=int(args.kv_cache_memory * 2**30), max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens, kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager, adaptive_speculation=args.adaptive_speculation,
            attention=args.attention), where
    except ValueError as e:   # e.g. --attention cpu where no compiler builds its kernel
        fail(str(e))
