"""Where a decode step's time goes, for each weight format and for the engine at 64 requests.

First each lossy format's mean KL from float32 on the run's prompt and the held-out text's first 256 tokens
(`minillm/course/quality.py`): a format past its bound gets no speed, only the reason. Then, for each format
within its bound:
- single-stream decode tokens/s (the kv stage, 64 greedy tokens after a short prompt) on the native backend
  (`minillm/backends/`), the formats taking turns round by round. Where this machine chose C loops for a
  decode's few rows (`backend_report`), the format runs again with torch's own kernel for every product
  (`speed_vs_torch_matmul`); where its blocks take the C path (`minillm/backends/c_block.py`, float32
  activations), again with the C products but the block as PyTorch operators (`speed_vs_pytorch_block`);
- the bytes a decode step must read (every weight once and the prompt's K/V), the tokens/s the machine's
  measured read bandwidth allows at that (the floor), and the fraction of it achieved: the bandwidth is
  measured in every round (on a shared virtual machine it moves by tens of percent from minute to minute),
  and the fraction is the median of each round's speed against that round's floor;
- one decode step split four ways (`minillm/course/step_profile.py`): matrix products, attention, the rest of
  the operators (norms, RoPE, SiLU, dtype conversions, K/V writes), and Python between them; the number of
  operators Python calls per step.
Then the engine (float32 weights): 64 requests with ~200-token prompts, once all are decoding, one decode-only
step split the same four ways, its FLOPs against the measured matmul rate, and the engine's own share of it:
the step's time outside the model's forward pass (scheduling, packing the batch, sampling, outputs). This is
done for the cpu attention backend (the C kernel reads pages in place; `engine`) and the torch backend
(pages gathered for SDPA; `engine.torch_split`), both with the weights packed for oneDNN as `serve` packs
them (`minillm/backends/packed.py`; `engine.packed_weights` is what the native backend chose,
`engine.unpacked_split` the cpu backend's step before packing), and the two engines also take turns step by step for a side-by-side step time
(`engine.by_attention`).
With `--peer-python PY` (a Python with llama-cpp-python), llama.cpp's single-stream decode on the same GGUF
file takes its turn in every round (the script of `quantization.py`; `speed_vs_llama_cpp` per format).

    python benchmarks/step_overhead.py [--rounds 3] [--peer-python PY] > benchmarks/results/cpu_step_overhead.json

`--engine-only` skips the formats: the machine's rates (measured `--rounds` times) and the engine's step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

import minillm
from minillm.course.bench import machine_info, provenance
from minillm.course.quality import check_quality, heldout_ids, refusal
from minillm.course.roofline import forward_flops, measure_matmul_flops, measure_read_bandwidth
from minillm.course.step_profile import bytes_per_token, step_split
import torch

from minillm.attention import cpu_kernel
from minillm.backends import apply_backend, c_block, report
from minillm.backends.native import settings
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.model import weight_bytes
from minillm.quant.linear import cpu_has_vnni
from minillm.sampling import SamplingParams
from minillm.stages import KVCacheRunner

PROMPT = "The history of the printing press begins in"
FORMATS = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "w8a8"), ("float32", "q4_file")]


TORCH, PYTORCH_BLOCK = ", torch kernels", ", C products, PyTorch block"


def variants(model) -> dict[str, dict]:
    """{name suffix: settings} to time for a native model: as it runs ("": the measured choices), with
    torch's kernels for every product where it sends some to C, and with the C products but the block as
    PyTorch operators where its blocks take the C path (float32 activations)."""
    v = {"": {}}
    uses_c = any((k["measured"] or {}).get("use_c") for k in report(model)["kernels"].values())
    if uses_c:
        v[TORCH] = {"c_rows": 0}
        if model.dtype == torch.float32 and c_block.load_library() is not None:
            v[PYTORCH_BLOCK] = {"blocks": False}
    return v


def load(dtype: str, quant: str | None):
    return minillm.load_model(dtype=dtype, quant=quant, backend="native")


def name_of(dtype: str, quant: str | None) -> str:
    return quant or dtype


def decode_step(model, ids: list[int]):
    """A function that runs one single-stream decode step at the prompt's context and forgets it again."""
    runner = KVCacheRunner(model, max_len=len(ids) + 8)
    runner.prefill(ids)
    length = runner.length

    def step():
        runner.decode(11)
        runner.truncate(length)
    return step


def decode_split(model, ids: list[int], repeats: int) -> dict:
    """One single-stream decode step at the prompt's context, split four ways."""
    return step_split(decode_step(model, ids), repeats=repeats)


def decoding_engine(model, tok, n: int = 64, prompt_tokens: int = 200, attention: str = "auto") -> LLMEngine:
    """An engine with n requests of prompt_tokens from the held-out text, every prompt in: its next steps are
    decode-only, n tokens each. attention: the paged backend ("cpu": the C kernel, "torch": gather + SDPA)."""
    text = heldout_ids(tok)
    engine = LLMEngine(model, tok, max_num_seqs=n, max_num_batched_tokens=512, attention=attention, verbose=False)
    for i in range(n):
        start = (i * 37) % (len(text) - prompt_tokens)
        engine.add_request(str(i), text[start:start + prompt_tokens], SamplingParams(max_tokens=512, ignore_eos=True))
    while engine.last_batch is None or engine.last_batch.total_tokens != n:   # until every prompt is in
        engine.step()
    return engine


def engine_split(model, engine: LLMEngine, repeats: int = 10) -> dict:
    """A decode-only step of a `decoding_engine`, split four ways, and its share outside the model."""
    n = len(engine.scheduler.running)
    context = statistics.mean(r.num_computed_tokens for r in engine.scheduler.running)
    split = step_split(engine.step, repeats=repeats, warmup=2)
    forward, walls = [], []
    model_forward = model.forward

    def timed_forward(*args, **kwargs):                     # the model's share of a step, timed from outside
        t0 = time.perf_counter()
        out = model_forward(*args, **kwargs)
        forward.append(time.perf_counter() - t0)
        return out
    model.forward = timed_forward
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    finally:
        del model.forward
    overhead = statistics.median(w - f for w, f in zip(walls, forward)) * 1e3
    flops = forward_flops(model.cfg, model.num_parameters(), n, int(context))
    return split | {"attention": engine.runner.attention, "requests": n, "mean_context": context, "step_flops": flops,
                    "engine_overhead_ms": overhead,
                    "engine_overhead_fraction": overhead / (statistics.median(walls) * 1e3),
                    "decode_tokens_per_s": n / (split["wall_ms"] / 1e3)}


def alternated_steps(engines: dict[str, LLMEngine], rounds: int, steps: int = 5) -> dict:
    """Decode-only steps of each engine (one per attention backend), taking turns step by step (`steps`
    per turn, `rounds` turns): median step ms, and each backend's speed against the last's."""
    backends = list(engines)
    times = {b: [] for b in backends}
    for _ in range(rounds + 1):                                  # the first turn warms up
        for b, engine in engines.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times[b].append(time.perf_counter() - t0)
    ms = {b: statistics.median(t[steps:]) * 1e3 for b, t in times.items()}
    return {b: {"step_ms": ms[b], "speed_vs_" + backends[-1]: ms[backends[-1]] / ms[b]} for b in backends}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20, help="profiled decode steps per format")
    ap.add_argument("--peer-python", default=None, help="a Python with llama-cpp-python (adds llama.cpp)")
    ap.add_argument("--engine-only", action="store_true", help="only the machine's rates and the engine's step")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from quantization import llama_peer, llama_turn

    tok = minillm.load_tokenizer()
    ids = tok.encode(PROMPT)
    held = heldout_ids(tok, max_tokens=256)
    formats = [f for f in FORMATS if f[1] != "w8a8" or cpu_has_vnni()]   # 8-bit activations: VNNI only
    if args.engine_only:
        formats = [("float32", None)]
    base = load("float32", None)
    models, gate = {}, {}
    for dtype, quant in tqdm(formats, desc="load and check", file=sys.stderr):
        name = name_of(dtype, quant)
        m = base if name == "float32" else load(dtype, quant)
        q = None if name == "float32" else check_quality(m, base, [ids, held])
        gate[name] = q
        if q is None or q["within_bound"]:
            models[name] = m
        else:
            print(refusal(q), file=sys.stderr)
    # the machine's read bandwidth and matmul rate, measured in every round with the formats: on a shared
    # virtual machine they move from minute to minute, so each round's speeds meet that round's floor
    bandwidths, matmul_rates = [], []
    speeds = {name: [] for name in models}
    # each format once more with torch's own kernel for every product (`minillm/backends/matvec.py` and the quantized
    # layers send a decode's few rows through C loops where this machine measured them faster), and float32
    # activations once more with the C products but the block as PyTorch operators (`minillm/backends/c_block.py`)
    modes = {name: variants(m) for name, m in models.items()}
    for name, v in modes.items():
        speeds |= {name + suffix: [] for suffix in v if suffix}
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    peer = None
    if args.peer_python:
        peer = llama_peer(args.peer_python, PROMPT, args.rounds + 1)
        speeds["llama.cpp"] = []
    for rnd in tqdm(range(args.rounds + 1), desc="rounds", file=sys.stderr):   # round 0 warms up
        for name, m in models.items() if not args.engine_only else ():
            for suffix, setting in modes[name].items():
                with settings(m, **setting):
                    p = params if rnd else SamplingParams(max_tokens=4)
                    tps = generate(m, tok, ids, p, stage="kv").decode_tokens_per_s
                if rnd:
                    speeds[name + suffix].append(tps)
        if peer:
            tps = llama_turn(peer)
            if rnd:
                speeds["llama.cpp"].append(tps)
        if rnd:
            bandwidths.append(measure_read_bandwidth(repeats=3))
            matmul_rates.append(measure_matmul_flops(repeats=3))
    read_bw, matmul_rate = statistics.median(bandwidths), statistics.median(matmul_rates)
    results = []
    for name, m in tqdm(models.items() if not args.engine_only else (), desc="profile", file=sys.stderr):
        tps = statistics.median(speeds[name])
        nbytes = bytes_per_token(m, len(ids) + 32)
        floor = read_bw / nbytes
        split = decode_split(m, ids, args.repeats)
        results.append({"format": name, "decode_tokens_per_s": tps, "runs": speeds[name],
                        "weight_bytes": weight_bytes(m), "bytes_per_token": nbytes,
                        "floor_tokens_per_s": floor,                  # each round against its own floor
                        "fraction_of_floor": statistics.median(t * nbytes / bw for t, bw in zip(speeds[name], bandwidths)),
                        "kl": gate[name]["kl"] if gate[name] else 0.0, "step": split})
        for suffix, key in ((TORCH, "torch_matmul"), (PYTORCH_BLOCK, "pytorch_block")):
            if name + suffix in speeds:
                other = statistics.median(speeds[name + suffix])
                results[-1] |= {f"{key}_tokens_per_s": other, f"{key}_runs": speeds[name + suffix],
                                f"speed_vs_{key}": tps / other}
        if args.peer_python:                     # of the medians, and the median of round-by-round ratios
            results[-1]["speed_vs_llama_cpp"] = tps / statistics.median(speeds["llama.cpp"])
            results[-1]["speed_vs_llama_cpp_by_round"] = statistics.median(
                a / b for a, b in zip(speeds[name], speeds["llama.cpp"]))
    llama = {"decode_tokens_per_s": statistics.median(speeds["llama.cpp"]), "runs": speeds["llama.cpp"]} if peer else None
    backends = ["cpu", "torch"] if cpu_kernel.available() else ["torch"]
    unpacked = engine_split(base, decoding_engine(base, tok, attention=backends[0]))   # F.linear's products
    packed = apply_backend(base, "native", pack_weights=True)     # as `serve` does: oneDNN's packed weights
    busy = {b: decoding_engine(packed, tok, attention=b) for b in backends}   # at the same contexts, used twice
    splits = {b: engine_split(packed, e) for b, e in busy.items()}
    for e in [*splits.values(), unpacked]:
        e["fraction_of_matmul_rate"] = e["step_flops"] / (e["wall_ms"] / 1e3) / matmul_rate
    engine = splits[backends[0]] | {"by_attention": alternated_steps(busy, args.rounds)}
    engine["torch_split"] = splits["torch"] if "cpu" in splits else None
    engine["packed_weights"] = report(packed)["kernels"]["float32 products"]
    engine["unpacked_split"] = unpacked
    print(json.dumps({"machine": machine_info(), **provenance(), "read_bytes_per_s": read_bw, "matmul_flops_per_s": matmul_rate,
                      "read_bytes_per_s_runs": bandwidths, "matmul_flops_per_s_runs": matmul_rates,
                      "backend": {name: report(m) for name, m in models.items()},
                      "prompt_tokens": len(ids), "rounds": args.rounds,
                      "refused": {k: refusal(q) for k, q in gate.items() if q and not q["within_bound"]},
                      "formats": results, "llama.cpp": llama, "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
