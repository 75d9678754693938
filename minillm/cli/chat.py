"""`python -m minillm chat`: a conversation in the terminal."""
from __future__ import annotations

import sys

from .common import check_speculative, load, sampling_params


def cmd_chat(args) -> None:
    from ..generate import stream

    params = sampling_params(args)
    check_speculative(args)
    model, tok, device = load(args)
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
                                num_speculative_tokens=args.num_speculative_tokens,
                                kv_cache_dtype=args.kv_cache_dtype, adaptive_speculation=args.adaptive_speculation):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
