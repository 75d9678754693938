"""`generate --tensor-parallel N`: spawn the ranks here, or be one of them under torchrun."""
from __future__ import annotations

import json
import os
import sys

from .common import fail


def generate_tensor_parallel(args, params) -> None:
    """Spawn the ranks here, or, started by torchrun (WORLD_SIZE set), be one of them."""
    from .. import ModelConfig, load_tokenizer
    from ..distributed import check_tensor_parallel, launch
    from ..generate import check_prompt

    others = {"--quant": args.quant, "--speculative": args.speculative, "--kv-cache-dtype": args.kv_cache_dtype,
              "--device": args.device, "--compile": args.compile or None}
    given = [flag for flag, value in others.items() if value is not None]
    if given or args.dtype != "float32":
        fail(f"--tensor-parallel runs the kv stage in float32 on this machine's CPU; drop {', '.join(given) or '--dtype'}")
    if args.stage not in ("naive", "kv", "continuous"):
        fail(f"--tensor-parallel runs the kv stage (the default) or the engine (--stage continuous); "
              f"drop --stage {args.stage}")
    engine = args.stage == "continuous"
    check_tensor_parallel(ModelConfig(), args.tensor_parallel)
    torchrun = "WORLD_SIZE" in os.environ
    if torchrun and int(os.environ["WORLD_SIZE"]) != args.tensor_parallel:
        fail(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tensor-parallel is {args.tensor_parallel}; "
              f"give torchrun --nproc-per-node {args.tensor_parallel}")
    rank_fn = launch.tensor_parallel_engine_rank if engine else launch.tensor_parallel_rank
    extra = ({"max_num_seqs": 1},) if engine else ()                 # the engine's options
    if torchrun and int(os.environ.get("RANK", 0)) != 0:             # a follower: no tokenizer, no output
        rank, world = launch.init_from_env()
        rank_fn(rank, world, None, params, *extra, args.model)
        launch.leave()
        return
    tok = load_tokenizer(args.model)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode_prompt(args.prompt)
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
