"""Regional compilation (`minillm/compile.py`) against eager, per weight format and for the engine.

For each format: one model, switched between eager and compiled blocks round by round (the same weights,
the same process), single-stream decode of the kv stage, 64 greedy tokens after a short prompt. Reported:
- the first compiled generation's time (2 tokens: the prefill and decode graphs compiled from nothing, in
  an empty inductor cache made for this run) and the same in a fresh process once that cache is filled;
- decode tokens/s, the median of the rounds for each variant, and their ratio;
- whether the greedy tokens are eager's (q4_file's logits are bfloat16 values: ties are common there, and
  a different summation order can break one the other way; the first differing position is given).
Then the engine (float32, torch attention) with 64 requests of ~200-token prompts, once all are decoding:
a decode-only step, eager and compiled in turns.

    python benchmarks/regional_compile.py [--rounds 5] > benchmarks/results/cpu_regional_compile.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import minillm
from minillm.compile import compile_blocks, eager_blocks
from minillm.course.bench import machine_info, provenance
from minillm.generate import generate
from minillm.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import decoding_engine  # noqa: E402

PROMPT = "The history of the printing press begins in"
FORMATS = [("float32", None), ("bfloat16", None), ("float32", "q4_file")]

WARM_START = """
import sys, time
t0 = time.perf_counter()
import minillm
from minillm.compile import compile_blocks
from minillm.generate import generate
from minillm.sampling import SamplingParams
tok = minillm.load_tokenizer()
model = compile_blocks(minillm.load_model(dtype=sys.argv[1], quant=sys.argv[2] or None))
loaded = time.perf_counter()
generate(model, tok, tok.encode(sys.argv[3]), SamplingParams(max_tokens=2), stage="kv")
print(time.perf_counter() - loaded)
"""


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def single_stream(dtype: str, quant: str | None, tok, ids: list[int], rounds: int) -> dict:
    model = minillm.load_model(dtype=dtype, quant=quant)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    eager = generate(model, tok, ids, params, stage="kv").token_ids
    compile_blocks(model)
    t0 = time.perf_counter()
    generate(model, tok, ids, SamplingParams(max_tokens=2), stage="kv")   # prefill and decode graphs
    first = time.perf_counter() - t0
    compiled = generate(model, tok, ids, params, stage="kv").token_ids
    speeds = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name in speeds:
            (eager_blocks if name == "eager" else compile_blocks)(model)
            speeds[name].append(generate(model, tok, ids, params, stage="kv").decode_tokens_per_s)
    warm = subprocess.run([sys.executable, "-c", WARM_START, dtype, quant or "", PROMPT],
                          capture_output=True, text=True, check=True)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    return {"format": quant or dtype, "cold_first_call_s": first, "warm_first_call_s": float(warm.stdout),
            "decode_tokens_per_s": med, "runs": speeds, "speedup": med["compiled"] / med["eager"],
            "same_greedy_tokens": eager == compiled, "first_difference": first_difference(eager, compiled)}


def engine_steps(tok, n: int = 64, prompt_tokens: int = 200, rounds: int = 5, steps: int = 4) -> dict:
    model = minillm.load_model()
    engine = decoding_engine(model, tok, n, prompt_tokens)                   # step_overhead.py's busy engine
    compile_blocks(model)
    t0 = time.perf_counter()
    engine.step()
    first = time.perf_counter() - t0
    times = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name in times:
            (eager_blocks if name == "eager" else compile_blocks)(model)
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"requests": n, "prompt_tokens": prompt_tokens, "first_compiled_step_s": first, "step_ms": med,
            "decode_tokens_per_s": {k: n / (v / 1e3) for k, v in med.items()}, "speedup": med["eager"] / med["compiled"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")   # cold, then warm (inherited)
    tok = minillm.load_tokenizer()
    ids = tok.encode(PROMPT)
    results = [single_stream(d, q, tok, ids, args.rounds) for d, q in tqdm(FORMATS, desc="formats", file=sys.stderr)]
    engine = engine_steps(tok, rounds=args.rounds)
    print(json.dumps({"machine": machine_info(), **provenance(), "prompt_tokens": len(ids), "rounds": args.rounds,
                      "single_stream": results, "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
