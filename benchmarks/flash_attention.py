"""FlashAttention kernels (stage 3) against naive attention and torch SDPA, on a GPU.

    python benchmarks/flash_attention.py                   # full sweep on a CUDA GPU (a few minutes)
    python benchmarks/flash_attention.py --smoke           # tiny sizes; runs anywhere (CPU: interpreter)

Prefill: causal, B x T tokens (B = 16K / T), 32 query heads, GQA ratios 1/4/8, head dims 64/128,
bf16. Reports ms, TFLOP/s (causal: 2 x 2 x B x H x T^2 x D / 2) for the Triton kernel, naive
attention (materialized scores; skipped where they would not fit) and torch SDPA (FlashAttention-2
on NVIDIA GPUs). Each Triton time is the best of a few tile configurations.

Decode: one query per sequence against a contiguous cache, split along the keys; reports achieved
bandwidth (K and V bytes read / time) against the GPU's measured copy bandwidth.

Paged decode (stage 4): the same decode through a shuffled block table (16-token pages) against the
contiguous kernel at equal context, both as fractions of copy bandwidth.

Writes JSON to benchmarks/results/flash_<gpu>.json (or the --out path).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from minillm.device import use_triton_interpreter  # noqa: E402

use_triton_interpreter()   # without a GPU: on before triton is imported
import triton  # noqa: E402

from minillm.attention import naive_attention  # noqa: E402
from minillm.attention.triton_flash import decode_attention, flash_attn_varlen  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402

PREFILL_CONFIGS = [dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                   dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
                   dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                   dict(block_m=128, block_n=32, num_warps=4, num_stages=4)]


def bench_ms(fn, device) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    import time
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(device) -> float:
    n = 1 << 28 if device.type == "cuda" else 1 << 22   # 1 GiB of float32 on GPU
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / (ms / 1e3)


def prefill_case(B, T, H, H_kv, D, dtype, device, naive_ok: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B * T, H, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B * T, H_kv, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B * T, H_kv, D, device=device, dtype=dtype, generator=g)
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    flops = 2 * 2 * B * H * T * T * D / 2                      # QK^T and PV, causal half
    row = {"batch": B, "seqlen": T, "heads": H, "kv_heads": H_kv, "head_dim": D, "dtype": str(dtype)}
    qb, kb, vb = (x.view(B, T, -1, D).transpose(1, 2) for x in (q, k, v))   # (B, heads, T, D) views
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)  # noqa
    ref = sdpa()
    best = None
    for cfg in (PREFILL_CONFIGS if device.type == "cuda" else [dict(block_m=32, block_n=32)]):
        try:
            out = flash_attn_varlen(q, k, v, cu, cu, T, T, causal=True, **cfg)
            err = (out.view(B, T, H, D).transpose(1, 2).float() - ref.float()).abs().max().item()
            ms = bench_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, T, T, causal=True, **cfg), device)
        except Exception as e:  # a config that does not fit this GPU's shared memory
            print(f"  config {cfg} failed: {type(e).__name__}", file=sys.stderr)
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg, err)
    row["triton_ms"], row["triton_config"], row["triton_max_abs_err_vs_sdpa"] = best
    row["sdpa_ms"] = bench_ms(sdpa, device)
    if naive_ok:
        row["naive_ms"] = bench_ms(lambda: naive_attention(qb, kb, vb), device)
    for name in ("triton", "sdpa", "naive"):
        if f"{name}_ms" in row:
            row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] / 1e3) / 1e12
    row["triton_vs_sdpa"] = row["triton_tflops"] / row["sdpa_tflops"]
    print(f"prefill B={B:<3} T={T:<6} H={H}/{H_kv} D={D}: triton {row['triton_tflops']:.1f} TFLOP/s, "
          f"sdpa {row['sdpa_tflops']:.1f}, naive {row.get('naive_tflops', float('nan')):.1f} "
          f"-> {row['triton_vs_sdpa']:.2f}x sdpa", flush=True)
    return row


def decode_case(B, ctx, H, H_kv, D, dtype, device, copy_bw) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, H, D, device=device, dtype=dtype, generator=g)
    kc = torch.randn(B, ctx, H_kv, D, device=device, dtype=dtype, generator=g)
    vc = torch.randn(B, ctx, H_kv, D, device=device, dtype=dtype, generator=g)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    ref = naive_attention(q[:, :, None].float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float())[:, :, 0]
    err = (decode_attention(q, kc, vc, lens).float() - ref).abs().max().item()
    ms = bench_ms(lambda: decode_attention(q, kc, vc, lens), device)
    bytes_read = kc.nbytes + vc.nbytes
    bw = bytes_read / (ms / 1e3)
    row = {"batch": B, "context": ctx, "heads": H, "kv_heads": H_kv, "head_dim": D, "dtype": str(dtype),
           "ms": ms, "bytes_read": bytes_read, "bandwidth_bytes_per_s": bw,
           "fraction_of_copy_bandwidth": bw / copy_bw, "max_abs_err": err}
    print(f"decode  B={B:<3} ctx={ctx:<6} H={H}/{H_kv} D={D}: {bw / 1e9:.0f} GB/s = "
          f"{row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth", flush=True)
    return row


def paged_decode_case(B, ctx, H, H_kv, D, block_size, dtype, device, copy_bw) -> dict:
    """The paged decode kernel against the contiguous one at equal context: same bytes, read through
    a shuffled block table (pages never adjacent)."""
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(B, H, D, device=device, dtype=dtype, generator=g)
    kc = torch.randn(B, ctx, H_kv, D, device=device, dtype=dtype, generator=g)
    vc = torch.randn(B, ctx, H_kv, D, device=device, dtype=dtype, generator=g)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    per_seq = ctx // block_size
    perm = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(3)).to(device)
    table = perm.view(B, per_seq).int()
    kp = torch.empty(B * per_seq, block_size, H_kv, D, device=device, dtype=dtype)
    vp = torch.empty_like(kp)
    kp[table.long()] = kc.view(B, per_seq, block_size, H_kv, D)   # the same keys, scattered over pages
    vp[table.long()] = vc.view(B, per_seq, block_size, H_kv, D)
    err = (decode_attention(q, kp, vp, lens, block_table=table).float()
           - decode_attention(q, kc, vc, lens).float()).abs().max().item()
    t_cont = bench_ms(lambda: decode_attention(q, kc, vc, lens), device)
    t_paged = bench_ms(lambda: decode_attention(q, kp, vp, lens, block_table=table), device)
    nbytes = kc.nbytes + vc.nbytes
    row = {"batch": B, "context": ctx, "heads": H, "kv_heads": H_kv, "head_dim": D, "block_size": block_size,
           "contiguous_ms": t_cont, "paged_ms": t_paged,
           "contiguous_fraction": nbytes / (t_cont / 1e3) / copy_bw, "paged_fraction": nbytes / (t_paged / 1e3) / copy_bw,
           "max_abs_diff_paged_vs_contiguous": err}
    print(f"paged   B={B:<3} ctx={ctx:<6} block {block_size}: contiguous {row['contiguous_fraction']:.0%}, "
          f"paged {row['paged_fraction']:.0%} of copy bandwidth", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs (CPU ok)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        sys.exit("no GPU here: run with --smoke to check the script, or on a machine with a CUDA GPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 tl.dot is unreliable in the interpreter
    info = machine_info()
    copy_bw = copy_bandwidth(device)
    print(f"{info['gpu'] or info['cpu']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    prefill, decode, paged = [], [], []
    if args.smoke:
        prefill.append(prefill_case(2, 48, 4, 2, 64, dtype, device, naive_ok=True))
        decode.append(decode_case(2, 100, 4, 2, 64, dtype, device, copy_bw))
        paged.append(paged_decode_case(2, 64, 4, 2, 64, 16, dtype, device, copy_bw))
    else:
        for D in (64, 128):
            for ratio in (1, 4, 8):
                for T in (1024, 2048, 4096, 8192, 16384):
                    B = max(1, 16384 // T)
                    prefill.append(prefill_case(B, T, 32, 32 // ratio, D, dtype, device, naive_ok=T <= 8192))
        for B in (1, 8, 32):
            for ctx in (2048, 8192, 16384, 32768):
                decode.append(decode_case(B, ctx, 32, 8, 128, dtype, device, copy_bw))
        for B in (8, 32):
            for ctx in (8192, 32768):
                paged.append(paged_decode_case(B, ctx, 32, 8, 128, 16, dtype, device, copy_bw))
    report = {"machine": info, **provenance(), "copy_bytes_per_s": copy_bw, "smoke": args.smoke, "prefill": prefill,
              "decode": decode, "paged_decode": paged}
    name = re.sub(r"[^a-z0-9]+", "_", (info["gpu"] or "cpu").lower()).strip("_")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"flash_{name}{'_smoke' if args.smoke else ''}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
