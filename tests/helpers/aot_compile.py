"""Compile the Triton kernels for an NVIDIA Hopper GPU (sm_90) ahead of time, without a GPU.

Run in a process *without* TRITON_INTERPRET, so triton builds real kernels. Catches what the
interpreter cannot: code that does not lower to GPU IR, or tiles that overflow shared memory.
Prints one line per kernel: "<name> OK <shared bytes>".
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minillm.attention import triton_flash as tf
from minillm.attention import triton_paged as tp
from minillm.quant import triton_matmul as tq

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a block may use on H100/H200


def build(fn, signature, constexprs, name, **options):
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=TARGET, options=options)
    assert kernel.metadata.shared <= SHARED_LIMIT, f"{name}: {kernel.metadata.shared} bytes of shared memory"
    print(name, "OK", kernel.metadata.shared)


def consts(names):
    return {n: "constexpr" for n in names}


# (activation dtype, head dim, paged, KV bits: 0 = a float cache, 8 = int8, 4 = 4-bit codes)
for dt, D, paged, bits in (("bf16", 128, False, 0), ("fp16", 64, True, 0), ("fp32", 64, False, 0),
                           ("bf16", 64, True, 8), ("fp16", 128, True, 4)):
    kv = {0: f"*{dt}", 8: "*i8", 4: "*u8"}[bits]
    scales = {"K_s": "*fp16" if bits else kv, "V_s": "*fp16" if bits else kv}
    tag = f"{dt}-d{D}{'-paged' if paged else ''}{f'-kv{bits}' if bits else ''}"
    sig = {"Q": f"*{dt}", "K": kv, "V": kv, "O": f"*{dt}", "cu_q": "*i32", "cu_k": "*i32",
           "scale_log2": "fp32", "block_table": "*i32", "s_bt": "i32",
           **{n: "i32" for n in ["sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "so_t", "so_h"]},
           **scales, "ss_t": "i32", "ss_h": "i32",
           **consts(["D", "GROUP", "CAUSAL", "IEEE", "BLOCK_M", "BLOCK_N", "BLOCK_D", "PAGED", "PAGE", "KV_BITS"])}
    build(tf._flash_fwd_kernel, sig, {"D": D, "GROUP": 4, "CAUSAL": True, "IEEE": dt == "fp32", "BLOCK_M": 64,
                                      "BLOCK_N": 64, "BLOCK_D": D, "PAGED": paged, "PAGE": 16, "KV_BITS": bits},
          f"prefill-{tag}", num_warps=4, num_stages=3)
    sig = {"Q": f"*{dt}", "K": kv, "V": kv, "seqlens": "*i32", "O_part": "*fp32", "LSE_part": "*fp32",
           "scale_log2": "fp32", "n_splits": "i32", "block_table": "*i32", "s_bt": "i32",
           **{n: "i32" for n in ["sq_b", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h",
                                 "so_b", "so_h", "so_s", "sl_b", "sl_h"]},
           **scales, "ss_b": "i32", "ss_t": "i32", "ss_h": "i32",
           **consts(["D", "GROUP", "IEEE", "BLOCK_H", "BLOCK_N", "BLOCK_D", "PAGED", "PAGE", "KV_BITS"])}
    build(tf._decode_split_kernel, sig, {"D": D, "GROUP": 4, "IEEE": dt == "fp32", "BLOCK_H": 16, "BLOCK_N": 64,
                                         "BLOCK_D": D, "PAGED": paged, "PAGE": 16, "KV_BITS": bits},
          f"decode-{tag}", num_warps=4)
sig = {"O_part": "*fp32", "LSE_part": "*fp32", "O": "*bf16", "n_splits": "i32",
       **{n: "i32" for n in ["so_b", "so_h", "so_s", "sl_b", "sl_h", "sO_b", "sO_h"]}, **consts(["D", "BLOCK_S", "BLOCK_D"])}
build(tf._decode_reduce_kernel, sig, {"D": 128, "BLOCK_S": 16, "BLOCK_D": 128}, "reduce")
sig = {"K_new": "*bf16", "V_new": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16", "slots": "*i64",
       "s_new_t": "i32", "s_new_v": "i32", "s_cache_t": "i32", **consts(["ROW", "BLOCK"])}
build(tp._write_slots_kernel, sig, {"ROW": 1024, "BLOCK": 1024}, "write-slots")
for q4 in (False, True):
    sig = {"X": "*bf16", "W": "*u8" if q4 else "*i8", "S": "*fp16" if q4 else "*fp32", "Mn": "*fp16" if q4 else "*fp32",
           "Y": "*bf16", **{n: "i32" for n in ["M", "N", "K", "sx_m", "sw_n", "ss_n", "sy_m"]},
           **consts(["Q4", "BLOCK_M", "BLOCK_N"])}
    build(tq._dequant_matmul_kernel, sig, {"Q4": q4, "BLOCK_M": 64, "BLOCK_N": 64}, f"matmul-{'q4' if q4 else 'int8'}",
          num_warps=4)
# Arguments that change from step to step are not specialized on (else a serving run compiles mid-request).
for fn in (tf._flash_fwd_kernel, tf._decode_split_kernel, tf._decode_reduce_kernel, tq._dequant_matmul_kernel):
    print("unspecialized", fn.__name__, " ".join(p.name for p in fn.params if p.do_not_specialize))
