"""`python -m minillm generate`: one prompt, streamed (or one JSON object)."""
from __future__ import annotations

import json
import sys

from .common import check_speculative, fail, load, sampling_params
from .tensor_parallel import generate_tensor_parallel


def cmd_generate(args) -> None:
    from ..generate import Generation, check_prompt, stream

    params = sampling_params(args)
    check_speculative(args)
    if args.tensor_parallel is not None:
        return generate_tensor_parallel(args, params)
    model, tok, device = load(args)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode_prompt(args.prompt)
    check_prompt(ids, model.cfg.max_seq_len)
    result = Generation(prompt_tokens=len(ids))
    try:
        for piece in stream(model, tok, ids, params, args.stage, result=result, speculative=args.speculative,
                            num_speculative_tokens=args.num_speculative_tokens, kv_cache_dtype=args.kv_cache_dtype,
                            enforce_eager=args.enforce_eager, adaptive_speculation=args.adaptive_speculation):
            if not args.json:
                print(piece, end="", flush=True)
    except ValueError as e:          # e.g. a draft with more layers than the model has
        fail(str(e))
    spec = {}
    if args.speculative is not None:
        spec = {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
                "adaptive_speculation": args.adaptive_speculation,
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
        k = f"k{'<=' if args.adaptive_speculation else '='}{args.num_speculative_tokens}"
        extra = (f"; {args.speculative} {k}: {result.acceptance_rate:.0%} of drafts "
                 f"accepted, {result.mean_accepted_tokens:.2f} per pass" if spec else "")
        print(f"[{len(result.token_ids)} tokens, {result.finish_reason}; ttft {result.ttft_s * 1e3:.0f} ms, "
              f"decode {result.decode_tokens_per_s:.1f} tok/s, stage {result.stage}, {device}{extra}]", file=sys.stderr)
