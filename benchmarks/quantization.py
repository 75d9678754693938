"""Quantized weights against float32, side by side in one process: speed, memory and quality.

First, for each format, its mean KL from float32 on this run's own prompt and the held-out text's first 256
tokens (the text its bound in `minillm/course/quality.py` was measured on; the prefill's random tokens are no
language, and move an 8-bit-activation model further): a format past its bound is not computing what the
model computes on this CPU, and gets no speed, only the reason. Then, for each format (float32, float16, bfloat16, int8, w8a8, q4, q4_file)
within its bound, taking turns round by round:
- single-stream decode tokens/s (the kv stage, 64 greedy tokens after a short prompt),
- batch-64 decode tokens/s (64 sequences, 8 steps),
- prefill tokens/s (one 256-token prompt, the last token's logits),
then once each: weight bytes, the resident memory a fresh process gains by loading the model that way
and running it once (the peak while loading is the float32 model's in every format), quality on
the held-out text (`data/heldout.txt`) against float32 (mean KL, top-1 agreement, perplexity) and greedy
agreement on the benchmark prompts (`data/prompts.jsonl`: tokens until the first difference, of 64).
The KV cache formats (float32, float16, int8, int4) get the same quality measures with float32 weights,
their bytes per token (this model and a Llama-3-8B shape), and single-stream decode at a 1,000-token
context, where reading the cache starts to count. With
`--peer-python PY` (a Python with llama-cpp-python), llama.cpp's single-stream decode on the same GGUF file
joins the rounds, and with `--profile` one q4_file decode step is broken down by operator.

    python benchmarks/quantization.py [--rounds 3] [--peer-python PY] > benchmarks/results/cpu_quantization.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from tqdm import tqdm

import minillm
from minillm.course.bench import load_prompts, machine_info, prompt_ids, provenance
from minillm.config import ModelConfig
from minillm.generate import generate
from minillm.kv import kv_cache_bytes
from minillm.sampling import SamplingParams
from minillm.quant import weight_bytes
from minillm.course.quality import KV_KL_BOUND, check_quality, compare, heldout_ids, next_token_logprobs, refusal
from minillm.stages import KVCacheRunner

PROMPT = "The history of the printing press begins in"
FORMATS = [("float32", None), ("float16", None), ("bfloat16", None), ("float32", "int8"), ("float32", "w8a8"),
           ("float32", "q4"), ("float32", "q4_file")]

LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
ids = llm.tokenize(sys.argv[2].encode(), add_bos=False)
for rnd in range(int(sys.argv[3])):
    sys.stdin.readline()                       # wait for our turn
    t = time.perf_counter(); n = 0
    for tok in llm.generate(ids, temp=0.0, reset=True):
        if n == 0: t = time.perf_counter()     # first token: prefill done
        n += 1
        if n > 64: break
    print(json.dumps({"decode_tokens_per_s": 64 / (time.perf_counter() - t)}), flush=True)
"""

def llama_peer(python: str, prompt: str, turns: int):
    """llama.cpp (llama-cpp-python in `python`) on the course model's GGUF file, waiting for its turns."""
    return subprocess.Popen([python, "-c", LLAMA_SCRIPT, str(minillm.find_model()), prompt, str(turns)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def llama_turn(peer) -> float:
    """One turn of llama.cpp's single-stream decode: tokens/s."""
    peer.stdin.write("go\n")
    peer.stdin.flush()
    return json.loads(peer.stdout.readline())["decode_tokens_per_s"]


RSS_SCRIPT = """
import gc, os, resource, sys, torch, minillm
torch.set_num_threads(2)
before = int(open("/proc/self/statm").read().split()[1])     # torch and minillm imported
m = minillm.load_model(dtype=sys.argv[1], quant=None if sys.argv[2] == "none" else sys.argv[2])
minillm.weights.gguf_reader.cache_clear()                    # the file's reader (vocabulary, mapped file)
m(torch.tensor([[1, 2, 3]]))
gc.collect()
now = int(open("/proc/self/statm").read().split()[1])        # resident now (loading peaks far higher)
page = os.sysconf("SC_PAGE_SIZE")
print(now * page, (now - before) * page, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
# glibc keeps freed memory of a big load in its heap unless big blocks are always mapped separately
RSS_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def name(dtype, quant):
    return quant or dtype


@torch.inference_mode()
def single_stream(model, ids, n=64) -> float:
    r = KVCacheRunner(model, max_len=256)
    logits = r.prefill(ids)
    t = time.perf_counter()
    for _ in range(n):
        logits = r.decode(int(logits.argmax()))
    return n / (time.perf_counter() - t)


@torch.inference_mode()
def batch_decode(model, ids, batch=64, steps=8) -> float:
    r = KVCacheRunner(model, max_len=128)
    logits = r.prefill_batch([ids] * batch)
    t = time.perf_counter()
    for _ in range(steps):
        logits = r.decode_batch(logits.argmax(-1).tolist())
    return batch * steps / (time.perf_counter() - t)


@torch.inference_mode()
def prefill(model, n=256) -> float:
    x = torch.randint(100, 10_000, (1, n), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    model(x, logit_indices=torch.tensor([n - 1]))
    return n / (time.perf_counter() - t)


def greedy_agreement(model, tok, refs: list[list[int]], prompts: list[list[int]], kv=None) -> list[int]:
    """Per prompt: how many of the reference's greedy tokens this model reproduces before the first difference."""
    out = []
    for ids, ref in zip(prompts, refs):
        got = generate(model, tok, ids, SamplingParams(max_tokens=len(ref), ignore_eos=True), stage="kv",
                       kv_cache_dtype=kv).token_ids
        out.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref)))
    return out


@torch.inference_mode()
def long_context_decode(model, kv, context=1000, n=32) -> float:
    r = KVCacheRunner(model, max_len=context + n + 1, kv_cache_dtype=kv)
    logits = r.prefill(torch.randint(100, 10_000, (context,), generator=torch.Generator().manual_seed(1)).tolist())
    t = time.perf_counter()
    for _ in range(n):
        logits = r.decode(int(logits.argmax()))
    return n / (time.perf_counter() - t)


def profile_step(model, ids, steps=20) -> list[dict]:
    """Self CPU time per decode step, by operator (the top 12)."""
    from torch.profiler import profile

    r = KVCacheRunner(model, max_len=256)
    r.prefill(ids)
    for _ in range(3):
        r.decode(5)
    with profile() as p:
        for _ in range(steps):
            r.decode(5)
    rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=None, help="a Python with llama-cpp-python (adds llama.cpp)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = minillm.load_tokenizer()
    ids = tok.encode(PROMPT)
    base = minillm.load_model()
    models = {}
    for dtype, quant in FORMATS:
        models[name(dtype, quant)] = (copy.deepcopy(base).to(minillm.parse_dtype(dtype)) if quant is None
                                      else minillm.load_model(quant=quant))
    held = heldout_ids(tok)
    gate = {k: check_quality(m, base, [ids, held[:256]]) for k, m in models.items()}   # before any timing
    refused = {k: refusal(q) for k, q in gate.items() if not q["within_bound"]}
    for why in refused.values():
        print(f"not timed: {why}", file=sys.stderr)
    timed = {k: m for k, m in models.items() if k not in refused}
    speed = {k: {"single_stream_decode": [], "batch64_decode": [], "prefill_256": []} for k in timed}
    peer = None
    if args.peer_python:
        peer = llama_peer(args.peer_python, PROMPT, args.rounds + 1)
        speed["llama.cpp"] = {"single_stream_decode": []}
    for rnd in tqdm(range(args.rounds + 1), desc="rounds", file=sys.stderr):   # round 0 warms up
        for k, m in timed.items():
            got = {"single_stream_decode": single_stream(m, ids), "batch64_decode": batch_decode(m, ids),
                   "prefill_256": prefill(m)}
            if rnd:
                for metric, v in got.items():
                    speed[k][metric].append(v)
        if peer:
            v = llama_turn(peer)
            if rnd:
                speed["llama.cpp"]["single_stream_decode"].append(v)

    ref = next_token_logprobs(base, held)
    results = []
    for dtype, quant in FORMATS:
        k = name(dtype, quant)
        rss, rss_model, peak = (int(x) for x in subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, dtype, quant or "none"], env=RSS_ENV,
            capture_output=True, text=True, check=True).stdout.split()[-3:])
        row = {"format": k, "dtype": dtype, "quant": quant, "weight_bytes": weight_bytes(models[k]), "rss_bytes": rss,
               "rss_model_bytes": rss_model, "peak_rss_bytes": peak,
               **({m: statistics.median(v) for m, v in speed[k].items()} if k in speed else
                  {"refused": refused[k], "single_stream_decode": None, "batch64_decode": None, "prefill_256": None}),
               "quality_gate": gate[k], **compare(ref, next_token_logprobs(models[k], held), held)}
        results.append(row)
    if peer:
        results.append({"format": "llama.cpp", "single_stream_decode": statistics.median(
            speed["llama.cpp"]["single_stream_decode"])})

    # greedy agreement on the benchmark prompts, 64 tokens, against float32
    bench_prompts = [prompt_ids(tok, p) for p in load_prompts()]
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    refs = [generate(base, tok, p, greedy, stage="kv").token_ids for p in bench_prompts]
    for row in results:
        if row["format"] in models:
            row["greedy_agreement"] = greedy_agreement(models[row["format"]], tok, refs, bench_prompts)

    # the KV cache: bytes, quality and long-context decode with float32 weights
    llama8b = ModelConfig(name="Llama-3-8B (shape only)", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                          n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_base=500000.0)
    kv_quality = {}
    for kv in ("float32", "float16", "int8", "int4"):
        m = models["float16"] if kv == "float16" else base
        kv_quality[kv] = compare(ref, next_token_logprobs(m, held, None if kv.startswith("float") else kv), held)
    kv_refused = {kv: f"KV {kv}: mean KL {q['kl']:.3f} from float32, past its bound of {KV_KL_BOUND[kv]:g}"
                  for kv, q in kv_quality.items() if kv in KV_KL_BOUND and q["kl"] > KV_KL_BOUND[kv]}
    kv_rows, kv_speed = [], {kv: [] for kv in kv_quality if kv not in kv_refused}
    for rnd in range(args.rounds):
        for kv in kv_speed:
            m = models["float16"] if kv == "float16" else base
            kv_speed[kv].append(long_context_decode(m, None if kv.startswith("float") else kv))
    for kv in kv_quality:
        q = None if kv.startswith("float") else kv
        m = models["float16"] if kv == "float16" else base
        dtype = torch.float16 if kv == "float16" else torch.float32
        per_token = kv_cache_bytes(base.cfg, 1, dtype, q)
        kv_rows.append({"kv_cache": kv, "bytes_per_token": per_token,
                        "tokens_per_gib": (1 << 30) // per_token,
                        "llama3_8b_bytes_per_token": kv_cache_bytes(llama8b, 1, dtype, q),
                        "decode_at_1000_tokens": statistics.median(kv_speed[kv]) if kv in kv_speed else None,
                        **({"refused": kv_refused[kv]} if kv in kv_refused else {}),
                        **kv_quality[kv], "greedy_agreement": greedy_agreement(m, tok, refs, bench_prompts, q)})
    out = {"machine": machine_info(), **provenance(), "threads": args.threads, "rounds": args.rounds, "heldout_tokens": len(held),
           "results": results, "kv_cache": kv_rows, "raw": speed, "raw_kv_decode": kv_speed}
    if args.profile:
        out["profile_q4_file_decode_step"] = profile_step(models["q4_file"], ids)
        out["profile_float32_decode_step"] = profile_step(base, ids)
    for r in results:
        if r.get("refused"):
            print(f"{r['format']:>10}  not timed (KL {r['quality_gate']['kl']:.3f} past {r['quality_gate']['bound']:g})",
                  file=sys.stderr)
            continue
        print(f"{r['format']:>10}  decode {r['single_stream_decode']:6.1f}  b64 {r.get('batch64_decode', 0):7.1f}  "
              f"prefill {r.get('prefill_256', 0):7.1f} tok/s  weights {r.get('weight_bytes', 0) / 1e6:6.1f} MB  "
              f"KL {r.get('kl', 0):.4f}  top1 {r.get('top1', 0):.3f}", file=sys.stderr)
    for r in kv_rows:
        if r.get("refused"):
            print(f"not timed: {r['refused']}", file=sys.stderr)
            continue
        print(f"KV {r['kv_cache']:>8}  {r['bytes_per_token']:6d} B/token  decode@1000 {r['decode_at_1000_tokens']:5.1f}  "
              f"KL {r['kl']:.4f}  top1 {r['top1']:.3f}  greedy {r['greedy_agreement']}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
