"""Launch settings of the attention kernels, swept on a GPU: which tile sizes, warps and pipeline stages
make the prefill kernel fastest against SDPA, and how many key slices per SM the decode kernel wants.

    python benchmarks/gpu_tuning.py        # on a CUDA GPU: writes benchmarks/results/gpu_<gpu>_tuning.json

The defaults in minillm/attention/triton_flash.py come from this sweep on an H200 (BLOCK_M = BLOCK_N = 64,
4 warps, 3 stages; 2 programs per SM for decode). Each setting is checked against SDPA (prefill) or the
default setting (decode) before it is timed. It takes about a minute.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PREFILL = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3),
           (64, 128, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 4), (128, 64, 4, 4),
           (128, 128, 4, 3)]                                             # block_m, block_n, warps, stages
DECODE = [(1, 8192), (8, 8192), (8, 32768), (32, 8192), (64, 4096), (128, 2048), (256, 1024)]   # batch, context


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this sweep times compiled kernels: run it on a machine with a CUDA GPU")
    import triton

    from minillm.attention import triton_flash as tf

    dev = torch.device("cuda")
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")   # noqa: E731
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    from minillm.course.bench import machine_info, provenance

    out = {"machine": machine_info(), **provenance(), "gpu": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
           "prefill": [], "decode": []}
    for T in (1024, 4096, 16384):
        B, H, H_kv, D = 16384 // T, 9, 3, 64
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B * T, h, D, generator=g).to(dev, torch.bfloat16) for h in (H, H_kv, H_kv))
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev)
        qb, kb, vb = (x.view(B, T, -1, D).transpose(1, 2) for x in (q, k, v))              # (B, heads, T, D)
        sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)  # noqa: E731
        ref, t_sdpa = sdpa(), bench(sdpa)
        for bm, bn, warps, stages in PREFILL:
            f = lambda: tf.flash_attn_varlen(q, k, v, cu, cu, T, T, block_m=bm, block_n=bn,  # noqa: E731
                                             num_warps=warps, num_stages=stages)
            err = rel(f().view(B, T, H, D).transpose(1, 2), ref)
            t = bench(f)
            out["prefill"].append({"tokens": T, "batch": B, "block_m": bm, "block_n": bn, "warps": warps,
                                   "stages": stages, "rel_error_vs_sdpa": err, "ms": t, "sdpa_ms": t_sdpa,
                                   "vs_sdpa": t_sdpa / t})
            print(f"prefill T={T:>6} {bm:>3}x{bn:<3} w{warps} s{stages}: {t_sdpa / t:.2f}x SDPA", flush=True)
    n = 1 << 28
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    out["copy_bytes_per_s"] = bw = 2 * src.nbytes / (bench(lambda: dst.copy_(src)) / 1e3)
    for B, L in DECODE:
        g = torch.Generator().manual_seed(B + L)
        q = torch.randn(B, 9, 64, generator=g).to(dev, torch.bfloat16)
        kc, vc = (torch.randn(B, L, 3, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        ref = tf.decode_attention(q, kc, vc, lens)
        for bn in (32, 64, 128):
            for per_sm in (1, 2, 4, 8, 16, 32):
                splits = max(1, min(triton.cdiv(per_sm * sms, B * 3), triton.cdiv(L, bn)))
                f = lambda: tf.decode_attention(q, kc, vc, lens, num_splits=splits, block_n=bn)   # noqa: E731
                err, t = rel(f(), ref), bench(f)
                out["decode"].append({"batch": B, "context": L, "block_n": bn, "programs_per_sm": per_sm,
                                      "splits": splits, "rel_error": err, "ms": t,
                                      "fraction_of_copy_bandwidth": (kc.nbytes + vc.nbytes) / (t / 1e3) / bw})
        best = max((r for r in out["decode"] if (r["batch"], r["context"]) == (B, L)),
                   key=lambda r: r["fraction_of_copy_bandwidth"])
        print(f"decode B={B} ctx={L}: best {best['fraction_of_copy_bandwidth']:.0%} of copy bandwidth "
              f"(block_n {best['block_n']}, {best['programs_per_sm']} per SM)", flush=True)
    name = re.sub(r"[^a-z0-9]+", "_", out["gpu"].lower()).strip("_").removeprefix("nvidia_")
    path = Path(__file__).parent / "results" / f"gpu_{name}_tuning.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
