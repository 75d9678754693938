"""The committed GPU run (`benchmarks/gpu.py` on an NVIDIA GPU), as the notebooks show it: one table per
question, its conclusion computed from the numbers, and every line labelled as a GPU result, never this
machine's."""
from __future__ import annotations

import json
import statistics

from .bench import RESULTS
from .prose import versus


def gpu_run() -> dict | None:
    """The committed benchmarks/results/gpu_*.json that ran on a GPU (not a dry run); None, with a line
    saying how to make one, when there is none."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("gpu_*.json"))]
    runs = [r for r in runs if not r.get("dry_run") and r.get("device_check", {}).get("gpu")]
    if not runs:
        print("No GPU run is committed in benchmarks/results/ yet. On a machine with an NVIDIA GPU, run\n"
              "    python benchmarks/gpu.py\nand these cells show its results.")
        return None
    return runs[-1]


def label(run: dict) -> str:
    """'committed GPU run: NVIDIA H200 (132 SMs), torch 2.11.0+cu130'."""
    d = run["device_check"]
    return f"committed GPU run: {d['gpu']} ({d['sms']} SMs), torch {d['machine']['torch']}"


def part(run: dict, name: str) -> dict | None:
    """One part of the run, or None (and why) if it failed or did not run."""
    p = run["parts"].get(name)
    if p is None or "error" in p:
        print(f"the GPU run has no '{name}' results" + (f": {p['error']}" if p else ""))
        return None
    return p


def show_prefill(run: dict) -> list[dict] | None:
    """Causal prefill in bfloat16, the course model's heads: the Triton kernel against SDPA and naive attention.
    Returns the rows (for a plot)."""
    p = part(run, "prefill")
    if p is None:
        return None
    print(label(run))
    print(f"{'':>13} {'TFLOP/s of causal work':^26}")
    print(f"{'tokens':>7} {'batch':>5} {'flash':>8} {'SDPA':>8} {'naive':>8}   flash vs SDPA   naive time / flash")
    for r in p["rows"]:
        print(f"{r['tokens']:>7,} {r['batch']:>5} {r['flash_tflops']:>8.0f} {r['sdpa_tflops']:>8.0f} "
              f"{r['naive_tflops']:>8.0f}   {r['flash_vs_sdpa']:>12.2f}×   {r['flash_vs_naive']:>17.1f}×")
    print("(every rate divides the same causal FLOP count, half of T × T, by the time: naive attention "
          "computes the whole T × T, twice that work, so its arithmetic runs at twice its printed rate)")
    ratios = [r["flash_vs_naive"] for r in p["rows"]]
    print(f"\nPredicted from bytes alone (section 3): naive moves about 8 × BLOCK_M / D = 8× the HBM traffic of the "
          f"kernel. Measured time: naive takes {min(ratios):.0f}× to {max(ratios):.0f}× as long, "
          f"{'more' if min(ratios) > 8 else 'less'} than the traffic predicts.")
    return p["rows"]


def show_decode(run: dict) -> list[dict] | None:
    """The decode kernel's bytes per second against a device-to-device copy measured in the same run."""
    p = part(run, "decode")
    if p is None:
        return None
    bw = p["copy_bytes_per_s"]
    print(f"{label(run)}; a copy moves {bw / 1e12:.2f} TB/s (bytes read + written)")
    floor = min(r["ms"] for r in p["rows"])
    print(f"{'batch':>5} {'context':>8} {'K/V read':>10} {'time':>9}   fraction of copy bandwidth")
    for r in p["rows"]:
        print(f"{r['batch']:>5} {r['context']:>8,} {r['bytes_read'] / 1e6:>7.0f} MB {r['ms'] * 1e3:>7.0f} µs"
              f"   {r['fraction_of_copy_bandwidth']:>6.0%}")
    big = [r["fraction_of_copy_bandwidth"] for r in p["rows"] if r["bytes_read"] >= 100e6]
    if big:
        print(f"\nWith at least 100 MB to read the kernel reaches {min(big):.0%} to {max(big):.0%} of the copy's "
              f"bandwidth. Below that no call takes less than {floor * 1e3:.0f} µs: a fixed cost per call (launching "
              f"two kernels and their buffers from Python, and a grid too small to fill the GPU), which a CUDA graph "
              f"shrinks.")
    return p["rows"]


def show_paged(run: dict) -> None:
    """Decode through a shuffled block table of 16-token pages against the same keys in a contiguous cache."""
    p = part(run, "paged")
    if p is None:
        return
    print(label(run))
    print(f"{'batch':>5} {'context':>8} {'contiguous':>11} {'paged':>9}   paged / contiguous")
    for r in p["rows"]:
        print(f"{r['batch']:>5} {r['context']:>8,} {r['contiguous_ms'] * 1e3:>8.0f} µs {r['paged_ms'] * 1e3:>6.0f} µs"
              f"   {r['paged_over_contiguous']:>8.2f}×")
    mid = statistics.median(r["paged_over_contiguous"] for r in p["rows"])
    decode = {(r["batch"], r["context"]): r["ms"] for r in (run["parts"].get("decode") or {}).get("rows", [])}
    for r in p["rows"]:
        other = decode.get((r["batch"], r["context"]))
        if other and abs(other / r["contiguous_ms"] - 1) > 0.2:
            print(f"(The same contiguous call, batch {r['batch']} at {r['context']:,}, took {other * 1e3:.0f} µs in the "
                  f"decode part of this run: between two parts of one run the time moved more than between paged "
                  f"and contiguous here, which is why each pair is timed side by side.)")
    most = max(r["paged_over_contiguous"] for r in p["rows"])
    big = max(p["rows"], key=lambda r: r["contiguous_ms"])     # the pair that reads longest: least launch in it
    print(f"\nThe median paged / contiguous ratio is {versus(mid, 1.0)} 1 (the largest {most:.2f}×). A pair that "
          f"takes about as long as one call's fixed cost (the shortest times above) says little about reading; the "
          f"longest, batch {big['batch']} at {big['context']:,}, reads the most: there the block table costs "
          f"{big['paged_over_contiguous']:.2f}×, one pair in one run, so a difference of that size is not resolved "
          f"by this run.")


def show_serving(run: dict) -> None:
    """The engine against transformers on the serving workload, and one stream with and without CUDA graphs."""
    s, one = part(run, "serving"), part(run, "single_stream")
    print(label(run))
    if s is not None:
        print(f"{'requests':>8} {'system':>13} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
              f"  (ms)")
        for n in (k for k in s if k.endswith("_requests")):
            for name in ("continuous", "transformers"):
                r = s[n].get(name)
                if r:
                    print(f"{n.split('_')[0]:>8} {name:>13} {r['output_tokens_per_s']:>7.0f} "
                          f"{r['ttft_s']['p50'] * 1e3:>9.0f} {r['ttft_s']['p99'] * 1e3:>9.0f} "
                          f"{r['itl_s']['p50'] * 1e3:>8.1f} {r['itl_s']['p99'] * 1e3:>8.1f}")
            if "engine_over_transformers" in s[n]:
                print(f"{'':>8} the engine's throughput is {s[n]['engine_over_transformers']:.1f}× transformers'")
    if one is not None:
        print(f"\nOne stream: decode steps replayed from CUDA graphs give {one['graphs_tokens_per_s']:.0f} tok/s, "
              f"{versus(one['graphs_tokens_per_s'], one['eager_tokens_per_s'])} the {one['eager_tokens_per_s']:.0f} "
              f"tok/s of the same steps launched one kernel at a time (same tokens: {one['same_tokens']}).")
    flips = run["parts"].get("flips") or {}
    f32 = flips.get("dtype", {}).get("float32")
    if f32:
        t1, t64 = 1 / f32["one_stream_tokens_per_s"], 64 / f32["batch_64_tokens_per_s"]
        print(f"A graphed decode step takes {t1 * 1e3:.1f} ms for 1 stream and {t64 * 1e3:.1f} ms for 64: "
              f"{t64 / t1:.1f}× the time for 64× the tokens.")


def show_chunk_budget(run: dict) -> None:
    """The serving workload (64 requests) through the engine at three token budgets per step."""
    p = part(run, "flips")
    if p is None:
        return
    rows = {int(b): r for b, r in p["chunk_budget"].items()}
    print(label(run) + "; 64 requests, all at once")
    print(f"{'budget':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    for b, r in sorted(rows.items()):
        print(f"{b:>7,} {r['output_tokens_per_s']:>7.0f} {r['ttft_s']['p50'] * 1e3:>9.0f} "
              f"{r['ttft_s']['p99'] * 1e3:>9.0f} {r['itl_s']['p50'] * 1e3:>8.1f} {r['itl_s']['p99'] * 1e3:>8.1f}")
    small, big = rows[min(rows)], rows[max(rows)]
    print(f"\nOn this GPU the {max(rows):,}-token budget gives throughput "
          f"{versus(big['output_tokens_per_s'], small['output_tokens_per_s'])} the {min(rows)}-token budget's, "
          f"and a TTFT p99 {versus(big['ttft_s']['p99'], small['ttft_s']['p99'])} it; its ITL p99 is "
          f"{versus(big['itl_s']['p99'], small['itl_s']['p99'])} the small budget's.")


def show_speculation(run: dict) -> None:
    """One stream on the GPU: plain decode (graphed) against two proposers drafting 4 tokens a round."""
    p = part(run, "flips")
    if p is None:
        return
    spec = p["speculative"]
    base = spec["none"]["decode_tokens_per_s"]
    print(label(run) + "; one request, 128 tokens, greedy")
    for name, r in spec.items():
        if "error" in r:
            print(f"{name:>10}: {r['error']}")
            continue
        same = "" if name == "none" else f"   same tokens as plain decode: {r['same_tokens']}"
        print(f"{name:>10}: {r['decode_tokens_per_s']:>5.0f} tok/s{same}")
    best = max((r["decode_tokens_per_s"], n) for n, r in spec.items() if n != "none" and "error" not in r)
    print(f"\nThe best proposer ({best[1]}) decodes at a rate {versus(best[0], base)} plain decoding's on this GPU.")
    one = run["parts"].get("single_stream") or {}
    if "eager_tokens_per_s" in one:
        print(f"Plain decoding launched kernel by kernel, as the speculative rounds are, makes "
              f"{one['eager_tokens_per_s']:.0f} tok/s (notebook 07): the best proposer's rate is "
              f"{versus(best[0], one['eager_tokens_per_s'])} that.")


def show_quantized(run: dict) -> None:
    """Each weight format on the GPU: KL from float32 and one stream's decode rate (the kv stage, eager)."""
    q, d = part(run, "quantized"), part(run, "flips")
    print(label(run))
    if q is not None:
        base = q["float32"]["decode_tokens_per_s"]
        print(f"{'format':>8} {'KL':>8} {'tok/s':>7}")
        print(f"{'float32':>8} {'':>8} {base:>7.0f}")
        old_q4 = q.get("q4_group", 32) == 32          # a run from before q4 took groups of 64
        for fmt, r in q.items():
            if fmt in ("float32", "seconds", "q4_group") or (fmt == "q4" and old_q4):
                continue
            if "error" in r:
                print(f"{fmt:>8}: {r['error']}")
            else:
                print(f"{fmt:>8} {r['kl']:>8.4f} {r['decode_tokens_per_s']:>7.0f}   "
                      f"{versus(r['decode_tokens_per_s'], base)} float32's rate")
        if old_q4 and "q4" in q:
            print("(q4 is left out: this run predates its groups of 64, so its q4 was the file's codes, q4_file again)")
    if d is not None and "bfloat16" in d["dtype"]:
        f32, bf16 = d["dtype"]["float32"], d["dtype"]["bfloat16"]
        for key, what in (("one_stream_tokens_per_s", "one stream"), ("batch_64_tokens_per_s", "64 streams")):
            print(f"{what}: bfloat16 decodes {bf16[key]:.0f} tok/s, {versus(bf16[key], f32[key])} float32's "
                  f"{f32[key]:.0f} (graphed decode steps)")
