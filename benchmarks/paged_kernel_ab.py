"""The CPU paged decode kernel against its own version at another commit, alone and in the engine's step.

    python benchmarks/paged_kernel_ab.py --against COMMIT [--rounds 5] [--out benchmarks/results/cpu_paged_kernel_ab.json]

`minillm/attention/cpu_paged.c` and the `vec.h` it includes are read from COMMIT (`git show`) into a
folder of their own and built beside this checkout's kernel (`cbuild.py`). Then, taking turns round by
round:
  kernel alone   30 layers' pools of keys and values (pages of 16, shuffled), n requests of one context
                 each, float32 and bfloat16 pages: ms for the 30 layers and the keys and values read per
                 second; both versions' outputs are first compared with a float64 reference
  engine step    `LLMEngine` with the native backend's packed weights (as `serve` runs it), n requests with
                 every prompt in, so each step decodes n tokens: three steps per turn, the kernel swapped
                 between turns (the engine is the same object: same pages, same contexts, growing by the
                 same amount on both sides)
Medians per version and their ratio. Everything but the kernel is the same on both sides.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import minillm  # noqa: E402
from minillm import cbuild  # noqa: E402
from minillm.attention import cpu_kernel  # noqa: E402
from minillm.backends import apply_backend  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402

H, H_KV, D, BS, LAYERS = 9, 3, 64, 16, 30              # the course model's attention
KERNEL_CASES = [(1, 300), (8, 600), (48, 200), (48, 1000)]
ENGINE_CASES = [(8, 600), (48, 200), (128, 100)]      # (requests, prompt tokens): the float32 pool holds them


def build_at(commit: str, folder: Path) -> cbuild.Library:
    """The kernel as it was at `commit`, built from a folder laid out like the package."""
    for path in ("minillm/attention/cpu_paged.c", "minillm/vec.h"):
        text = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    lib = cbuild.load(folder / "minillm/attention/cpu_paged.c", cpu_kernel.SIGNATURES)
    if lib is None:
        raise SystemExit("the kernel at that commit does not build here")
    return lib


def pools(n: int, context: int, dtype: torch.dtype) -> dict:
    """Every layer's pages for n requests of `context` keys, shuffled over the pool, and their queries."""
    width = -(-context // BS)
    blocks = n * width + 1
    g = torch.Generator().manual_seed(n * 1000 + context)
    return {"k": [torch.randn(blocks, BS, H_KV, D, generator=g).to(dtype) for _ in range(LAYERS)],
            "v": [torch.randn(blocks, BS, H_KV, D, generator=g).to(dtype) for _ in range(LAYERS)],
            "table": torch.randperm(blocks - 1, generator=g)[:n * width].view(n, width).to(torch.int32).contiguous(),
            "q": torch.randn(n, H, D, generator=g).to(dtype), "rows": torch.arange(n),
            "lens": torch.full((n,), context, dtype=torch.int32)}


def run_layers(lib, case: dict, layers: int = LAYERS) -> torch.Tensor:
    cpu_kernel.load_library = lambda: lib                     # paged_decode calls it for its library
    out = torch.empty_like(case["q"])
    for i in range(layers):
        cpu_kernel.paged_decode(case["q"], case["k"][i], case["v"][i], case["rows"], case["table"], case["lens"], out)
    return out


def reference(case: dict) -> torch.Tensor:
    """The last layer's attention in float64."""
    k, v, table = case["k"][-1], case["v"][-1], case["table"]
    n, context = table.shape[0], int(case["lens"][0])
    t = torch.arange(context)
    pages = table[:, t // BS].long()                                          # (n, context)
    keys = k[pages, t % BS].double().permute(0, 2, 1, 3).repeat_interleave(H // H_KV, 1)   # (n, H, context, D)
    vals = v[pages, t % BS].double().permute(0, 2, 1, 3).repeat_interleave(H // H_KV, 1)
    s = (case["q"].double()[:, :, None, :] @ keys.transpose(-1, -2)) * D ** -0.5            # (n, H, 1, context)
    return (s.softmax(-1) @ vals)[:, :, 0]


def kernel_alone(libs: dict, rounds: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, context in tqdm(KERNEL_CASES, desc=f"kernel alone, {dtype}", file=sys.stderr):
            case = pools(n, context, dtype)
            ref = reference(case)
            errors = {name: (run_layers(lib, case).double() - ref).abs().max().item() for name, lib in libs.items()}
            times = {name: [] for name in libs}
            for r in range(rounds + 1):                          # the first round warms up
                for name, lib in libs.items():
                    t0 = time.perf_counter()
                    run_layers(lib, case)
                    if r:
                        times[name].append((time.perf_counter() - t0) * 1e3)
            nbytes = n * LAYERS * H_KV * context * D * 2 * case["k"][0].element_size()
            ms = {name: statistics.median(t) for name, t in times.items()}
            rows.append({"dtype": str(dtype).removeprefix("torch."), "requests": n, "context": context,
                         "kv_bytes": nbytes, "ms": ms, "runs_ms": times, "max_abs_error": errors,
                         "gb_per_s": {name: nbytes / m / 1e6 for name, m in ms.items()},
                         "speedup": ms["before"] / ms["now"]})
    return rows


def engine_steps(libs: dict, rounds: int) -> list[dict]:
    from step_overhead import decoding_engine

    tok, rows = minillm.load_tokenizer(), []
    for dtype in ("float32", "bfloat16"):
        model = apply_backend(minillm.load_model(dtype=dtype, backend="native"), "native", pack_weights=True)
        for n, prompt in tqdm(ENGINE_CASES, desc=f"engine, {dtype}", file=sys.stderr):
            engine = decoding_engine(model, tok, n=n, prompt_tokens=prompt)
            times = {name: [] for name in libs}
            for r in range(rounds + 1):
                for name, lib in libs.items():
                    cpu_kernel.load_library = lambda lib=lib: lib
                    t0 = time.perf_counter()
                    for _ in range(3):
                        engine.step()
                    if r:
                        times[name].append((time.perf_counter() - t0) / 3 * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            rows.append({"dtype": dtype, "requests": n, "prompt_tokens": prompt, "step_ms": ms, "runs_ms": times,
                         "speedup": ms["before"] / ms["now"]})
            del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the commit whose kernel to race")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu_paged_kernel_ab.json"))
    args = ap.parse_args()
    built = cpu_kernel.load_library()
    if built is None:
        raise SystemExit("no C compiler built the kernel here")
    with tempfile.TemporaryDirectory() as folder:
        libs = {"before": build_at(args.against, Path(folder)), "now": built}
        alone = kernel_alone(libs, args.rounds)
        steps = engine_steps(libs, args.rounds)
    against = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    result = {"machine": machine_info(), **provenance(), "against": against, "rounds": args.rounds,
              "kernel_alone": alone, "engine_step": steps}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in alone:
        print(f"kernel {r['dtype']:8} {r['requests']:3} x {r['context']:4}: {r['ms']['before']:7.2f} -> "
              f"{r['ms']['now']:7.2f} ms  x{r['speedup']:.2f}  ({r['gb_per_s']['now']:.1f} GB/s)")
    for r in steps:
        print(f"step   {r['dtype']:8} {r['requests']:3} x {r['prompt_tokens']:4}: {r['step_ms']['before']:7.1f} -> "
              f"{r['step_ms']['now']:7.1f} ms  x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()
