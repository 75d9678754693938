"""The backends side by side on this CPU: what the native backend buys over the plain model (torch), and
where it stands against llama.cpp on the same file.

- single-stream decode tokens/s (the kv stage, 64 greedy tokens after a short prompt) of the float32 model
  and of the 4-bit file (q4_file), each on the torch backend and on the native one, all taking turns
  round by round; with `--peer-python PY` (a Python with llama-cpp-python) llama.cpp's decode of the same
  GGUF file takes its turn in every round (`quantization.py`'s script);
- the engine's decode-only step at 64 requests (~200-token prompts, float32): torch (F.linear, gathered
  pages + SDPA) against native (C paged attention, oneDNN's packed weights where they measure faster, as
  `serve` runs), the two engines taking turns step by step.

Every ratio is a median of round-by-round ratios; each side's median and spread are kept as well. What the
native backend chose (its races) is in `backend`.

    python benchmarks/backends.py [--rounds 5] [--peer-python PY] > benchmarks/results/cpu_backends.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import minillm
from minillm.backends import apply_backend, report
from minillm.course.bench import machine_info, provenance
from minillm.course.quality import heldout_ids
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.sampling import SamplingParams

PROMPT = "The history of the printing press begins in"


def decoding_engine(model, tok, n: int = 64, prompt_tokens: int = 200) -> LLMEngine:
    """n requests of prompt_tokens from the held-out text, every prompt in: the next steps decode only."""
    text = heldout_ids(tok)
    engine = LLMEngine(model, tok, max_num_seqs=n, max_num_batched_tokens=512, verbose=False)
    for i in range(n):
        start = (i * 37) % (len(text) - prompt_tokens)
        engine.add_request(str(i), text[start:start + prompt_tokens], SamplingParams(max_tokens=512, ignore_eos=True))
    while engine.last_batch is None or engine.last_batch.total_tokens != n:
        engine.step()
    return engine


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "runs": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="engine steps per turn")
    ap.add_argument("--peer-python", default=None, help="a Python with llama-cpp-python (adds llama.cpp)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from quantization import llama_peer, llama_turn

    torch.set_num_threads(2)
    tok = minillm.load_tokenizer()
    ids = tok.encode(PROMPT)
    plain = {"float32": minillm.load_model(), "q4_file": minillm.load_model(quant="q4_file")}
    models = {f"{name}, {b}": apply_backend(m, b) for name, m in plain.items() for b in ("torch", "native")}
    speeds = {k: [] for k in models}
    peer = None
    if args.peer_python:
        peer = llama_peer(args.peer_python, PROMPT, args.rounds + 1)
        speeds["llama.cpp, q4_file"] = []
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for rnd in tqdm(range(args.rounds + 1), desc="single stream", file=sys.stderr):     # round 0 warms up
        for k, m in models.items():
            tps = generate(m, tok, ids, params if rnd else SamplingParams(max_tokens=4), stage="kv").decode_tokens_per_s
            if rnd:
                speeds[k].append(tps)
        if peer:
            tps = llama_turn(peer)
            if rnd:
                speeds["llama.cpp, q4_file"].append(tps)
    by_round = lambda a, b: statistics.median(x / y for x, y in zip(speeds[a], speeds[b]))   # noqa: E731
    single = {k: summary(v) for k, v in speeds.items()}
    ratios = {f"{n}: native / torch": by_round(f"{n}, native", f"{n}, torch") for n in plain}
    if peer:
        ratios["q4_file: native / llama.cpp"] = by_round("q4_file, native", "llama.cpp, q4_file")
        ratios["q4_file: torch / llama.cpp"] = by_round("q4_file, torch", "llama.cpp, q4_file")
    del models
    engines = {"torch": decoding_engine(plain["float32"], tok),
               "native": decoding_engine(apply_backend(plain["float32"], "native", pack_weights=True), tok)}
    steps = {b: [] for b in engines}
    for rnd in tqdm(range(args.rounds + 1), desc="engine steps", file=sys.stderr):
        for b, engine in engines.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                if rnd:
                    steps[b].append((time.perf_counter() - t0) * 1e3)
    step_ratio = statistics.median(t / n for t, n in zip(steps["torch"], steps["native"]))
    print(json.dumps({"machine": machine_info(), **provenance(), "rounds": args.rounds, "single_stream_tokens_per_s": single,
                      "ratios": ratios | {"engine step: torch ms / native ms": step_ratio},
                      "engine_step_ms": {b: summary(v) for b, v in steps.items()},
                      "engine_attention": {b: e.runner.attention for b, e in engines.items()},
                      "backend": {"float32": report(engines["native"].model),
                                  "q4_file": report(apply_backend(plain["q4_file"], "native"))}}, indent=1))


if __name__ == "__main__":
    main()
