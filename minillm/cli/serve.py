"""`python -m minillm serve`: the OpenAI-compatible server."""
from __future__ import annotations

import sys

from .common import check_speculative, fail, load


def cmd_serve(args) -> None:
    from ..engine import LLMEngine
    from ..server import serve

    args.stage = "continuous"
    check_speculative(args)
    if args.port < 0 or args.port > 65535 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1 or \
            args.kv_cache_memory <= 0 or (args.max_queued_requests is not None and args.max_queued_requests < 1) or \
            args.max_tokens_default < 1:
        fail("--port must be in [0, 65535]; --max-num-seqs, --max-num-batched-tokens, --max-queued-requests and "
             "--max-tokens-default >= 1; --kv-cache-memory > 0")
    model, tok, device = load(args)
    engine = LLMEngine(model, tok, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=int(args.kv_cache_memory * 2**30), max_model_len=args.max_model_len,
                       enable_prefix_caching=not args.no_prefix_caching, speculative=args.speculative,
                       num_speculative_tokens=args.num_speculative_tokens, kv_cache_dtype=args.kv_cache_dtype,
                       enforce_eager=args.enforce_eager, adaptive_speculation=args.adaptive_speculation)
    name = args.served_model_name or model.cfg.name
    print(f"minillm: serving {name} on http://{args.host}:{args.port}/v1 ({device})", file=sys.stderr, flush=True)
    serve(engine, name, args.host, args.port, args.api_key, args.max_queued_requests, args.graceful_timeout,
          max_tokens_default=args.max_tokens_default)
