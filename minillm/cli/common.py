"""What every command shares: a one-line failure, the model and tokenizer, sampling settings, the
checks of speculative settings and of a lossy precision before it is timed."""
from __future__ import annotations

import sys

import torch


def fail(msg: str) -> None:
    print(f"minillm: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def sampling_params(args):
    from ..sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed)


def load(args, pack_weights: bool = False, say_backend: bool = False):
    """The model (quantized, prepared for --backend, compiled as asked), its tokenizer, and the device.
    say_backend: print which kernels the backend chose (stderr)."""
    from .. import load_model, load_tokenizer
    from ..backends import apply_backend, describe
    from ..device import pick_device

    if args.threads is not None:
        if args.threads < 1:
            fail(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.compile and getattr(args, "enforce_eager", False):
        fail("--compile and --enforce-eager contradict each other: choose one")
    try:
        device = str(pick_device(args.device))
    except (ValueError, RuntimeError):    # RuntimeError: not a device name torch knows
        fail(f"--device {args.device} asked for, but this torch build sees no such device; use --device cpu")
    tok = load_tokenizer(args.model)
    try:
        model = load_model(args.model, device=device, dtype=args.dtype, quant=args.quant)
    except ValueError as e:   # e.g. q4_file with a model that is not a Q4_1 GGUF file
        fail(str(e))
    try:
        model = apply_backend(model, getattr(args, "backend", "auto"), pack_weights=pack_weights)
    except ValueError as e:   # native on a GPU
        fail(str(e))
    if say_backend:
        print("\n".join(describe(model)), file=sys.stderr)
    if args.compile:
        from ..compile import compile_blocks

        compile_blocks(model)
    return model, tok, device


def check_speculative(args) -> None:
    if args.adaptive_speculation and args.speculative is None:
        fail("--adaptive-speculation chooses how many tokens --speculative drafts: give --speculative too")
    if args.speculative is None:
        return
    from ..speculative import make_proposer

    try:
        make_proposer(args.speculative)
    except ValueError as e:
        fail(str(e))
    if args.stage == "naive":
        fail("--speculative needs a stage with a KV cache to roll back: kv, flash, paged or continuous")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        fail(f"--num-speculative-tokens must be >= 1; got {args.num_speculative_tokens}")
    from ..speculative.adaptive import speculation_settings

    args.adaptive_speculation, args.num_speculative_tokens = speculation_settings(
        args.speculative, args.adaptive_speculation, args.num_speculative_tokens)   # the defaults, said


def check_quality(args, model, device, prompts: list[list[int]]) -> dict | None:
    """A lossy precision (quantized weights, half-precision floats, a quantized KV cache) gets its speed
    measured only where it computes what float32 does: its mean KL from float32 on the run's own prompts
    within its bound (`course/quality.py`). Past it, the run ends saying so."""
    from .. import load_model
    from ..course.quality import check_quality, kl_bound, refusal

    kv = getattr(args, "kv_cache_dtype", None)
    if kl_bound(model, kv) is None:
        return None
    q = check_quality(model, load_model(args.model, device=device), prompts, kv)
    if not q["within_bound"]:
        fail(refusal(q))
    if not args.json:
        print(f"{q['format']}: mean KL {q['kl']:.4f} from float32 on these prompts ({q['tokens']} tokens; "
              f"bound {q['bound']:g})", file=sys.stderr)
    return q
