"""A block's two halves around attention in one C call each, for a decode's few rows (`c_block.c`), or the
whole block in one call where C can write and read the attention context's cache itself.

`Block.before_attention` (RMSNorm, the Q/K/V product, RoPE) and `Block.after_attention` (the output product,
the residual, RMSNorm, the SwiGLU MLP, the residual) run about 35 PyTorch operators per layer; for one row
of activations each does a few microseconds of work and costs a few more to dispatch. Here each half is one
call into C, with the products of `matvec.c` in each weight's own format. Attention stays in Python, with
the stage's attention context, so every stage can use it. Where the context is stage 2's contiguous cache
in float32 with causal SDPA (`CachedAttention.in_place`), `layer` does the whole block, cache write and
attention included, in one call: about 30 dispatches of Python per layer become one.

A block takes this path when its activations are float32 rows on a CPU, at most `matvec.MAX_ROWS` of them,
every weight is float32, int8 rows (`Int8Linear`) or Q4_1 blocks (`Q4Linear`), and the products would run
in C anyway: where this machine measured the C loops faster for that many rows (`matvec.choice`, and each
quantized layer's `c_rows`), or under `matvec.using("c")`. `matvec.using("torch")` turns it off, and so does

    with c_block.using(False): ...     the same products in C, the other operators in PyTorch (to compare)

The arithmetic is the same in float32, in another order: logits agree to rounding, greedy tokens match (tests).
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from . import matvec, native

SOURCE = Path(__file__).with_name("c_block.c")
PROFILER_NAME = "minillm::c_block"     # what torch.profiler sees: the products, with the norms, RoPE and SiLU
LAYER_PROFILER_NAME = "minillm::c_layer"   # a whole block: the same, with the cache write and attention
W_FLOAT32, W_INT8, W_Q4_1 = 0, 2, 3
_enabled = True


@lru_cache(maxsize=1)
def load_library():
    built = native.load(SOURCE)
    if built:
        lib, p, i32, i64, f32 = built[0], ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        w = [i32, p, p, p]                                              # a weight: kind and three tensors
        lib.block_before.argtypes = [p, i32, i32, i32, p, f32, *w, i64, p, p, i32, i32, i32, p, i32]
        lib.block_after.argtypes = [p, p, p, i64, i64, i64, i32, i32, i32, i32, p, f32, *w, i32, *w, i64, *w, i32]
        lib.block_layer.argtypes = [p, p, i32, i32, i32, p, f32, *w, p, p, i32, i32, i32, i32, p, p, i64, p,
                                    p, f32, *w, *w, i64, *w, i32]
        lib.block_before.restype = lib.block_after.restype = lib.block_layer.restype = i32
    return built


def _call(name: str, *args) -> int:
    f = getattr(load_library()[0], name)
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(LAYER_PROFILER_NAME if name == "block_layer" else PROFILER_NAME):
            return f(*args)
    return f(*args)


@contextmanager
def using(enabled: bool):
    """Whether blocks may take the C path inside the block (default True)."""
    global _enabled
    old, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = old


def _describe(layer) -> tuple | None:
    """(kind, a, b, c): a layer's weight as the C code takes it, or None where it has no C product."""
    from .model import Linear
    from .quant.linear import Int8Linear, Q4Linear
    if type(layer) is Linear and layer.weight.dtype == torch.float32 and layer.in_features % 16 == 0:
        return W_FLOAT32, layer.weight.data_ptr(), None, None
    if type(layer) is Int8Linear and layer.in_features % 16 == 0:
        return W_INT8, layer.q.data_ptr(), layer.scale.data_ptr(), None
    if type(layer) is Q4Linear and hasattr(layer, "c_tiles"):
        return W_Q4_1, layer.c_tiles.data_ptr(), layer.c_scale.data_ptr(), layer.c_min.data_ptr()
    return None


def _max_rows(layer) -> int:
    """Up to how many rows this machine measured the layer's C product faster (0: never)."""
    rows = layer.__dict__.get("c_rows")                    # quantized layers: measured on their model
    return rows if rows is not None else (matvec.choice(torch.float32) or {}).get("max_rows", 0)


def _weights(block, x: torch.Tensor) -> list[tuple] | None:
    """The block's four weights as C arguments, or None where the block does not take the C path for x.
    Described once per block and kept, again if a layer or its weight tensor is replaced. (This runs twice
    per layer per step, so it reads `_modules`, `_parameters` and `_buffers` directly and checks what it
    kept with plain identity tests: `block.attn.wqkv` costs a microsecond or two per step of the chain.)"""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or not _enabled or matvec._mode == "torch":
        return None
    rows = x.numel() // x.shape[-1]
    if (x.dtype != torch.float32 or not 0 < rows <= matvec.MAX_ROWS or torch.is_grad_enabled()
            or load_library() is None):
        return None
    kept = block.__dict__.get("_c_weights")
    if kept is None or not _unchanged(kept[0]):
        attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]._modules
        layers = (attn["wqkv"], attn["wo"], mlp["w_gate_up"], mlp["w_down"])
        kept = (_checks(block, layers), [_describe(layer) for layer in layers], layers)
        block.__dict__["_c_weights"] = kept
    _, found, layers = kept
    if None in found:
        return None
    if matvec._mode != "c":
        for layer in layers:                            # measured per layer, and may be measured again
            if rows > _max_rows(layer):
                return None
    return found


def _checks(block, layers) -> list[tuple]:
    """(dict, key, value) triples that hold while the block's layers and their weight tensors are the same."""
    attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]._modules
    names = ((attn, "wqkv"), (attn, "wo"), (mlp, "w_gate_up"), (mlp, "w_down"))
    checks = [(d, k, layer) for (d, k), layer in zip(names, layers)]
    for layer in layers:
        for store in (layer._buffers, layer._parameters):
            for name in ("c_tiles", "q", "weight"):
                if store.get(name) is not None:
                    checks.append((store, name, store[name]))
    return checks


def _unchanged(checks: list[tuple]) -> bool:
    for d, k, v in checks:
        if d.get(k) is not v:
            return False
    return True


def before_attention(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Block.before_attention in one call: x (B, T, d) -> q (B, H, T, hd), k and v (B, n_kv, T, hd);
    None where the block does not take the C path (the caller runs its own)."""
    w = _weights(block, x)
    if w is None:
        return None
    a, norm, (B, T, d) = block._modules["attn"], block._modules["attn_norm"], x.shape
    H, n_kv, hd = a.n_heads, a.n_kv, a.hd
    x = x.contiguous()
    if cos.dim() != 2:
        cos, sin = cos.reshape(-1, hd), sin.reshape(-1, hd)       # (B, 1, T, hd) -> (B T, hd)
    cos, sin = cos.contiguous(), sin.contiguous()                # row i of x turns by row i % len(cos)
    qkv = torch.empty(B, H + 2 * n_kv, T, hd)                    # written head-major: q, k, v are views
    rc = _call("block_before",
        x.data_ptr(), B * T, T, d, norm._parameters["weight"].data_ptr(), norm.eps, *w[0], qkv.shape[1] * hd,
        cos.data_ptr(), sin.data_ptr(), cos.shape[0], H + n_kv, hd, qkv.data_ptr(), torch.get_num_threads())
    assert rc == 0, "block_before: shapes past the C code's limits"
    return torch.split_with_sizes(qkv, [H, n_kv, n_kv], 1)          # (B, H | n_kv | n_kv, T, hd)


def after_attention(block, x: torch.Tensor, out: torch.Tensor):
    """Block.after_attention in one call: x (B, T, d), out (B, H, T, hd) -> the block's output (B, T, d);
    None where the block does not take the C path."""
    w = _weights(block, x)
    if w is None:
        return None
    B, T, d = x.shape
    x, y = x.contiguous(), torch.empty(B, T, d)                          # the residual stream, in and out
    if out.stride(-1) != 1:
        out = out.contiguous()
    so = out.stride()                                                   # out (B, H, T, hd) read in place
    norm, gate_up = block._modules["ffn_norm"], block._modules["mlp"]._modules["w_gate_up"]
    rc = _call("block_after",
        x.data_ptr(), y.data_ptr(), out.data_ptr(), so[0], so[1], so[2], T, out.shape[3], B * T, d,
        norm._parameters["weight"].data_ptr(), norm.eps,
        *w[1], out.shape[1] * out.shape[3], *w[2], gate_up.out_features, *w[3], torch.get_num_threads())
    assert rc == 0, "block_after: shapes past the C code's limits"
    return y


def layer(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, index: int):
    """Block.forward in one call, attention included, where the attention context lets C write and read its
    cache in place (`attn.in_place(index)`: a contiguous float32 cache, causal attention by SDPA): x (B, T, d)
    -> the block's output (B, T, d); None where the block or the context does not take this path."""
    in_place = getattr(attn, "in_place", None)
    cache = in_place(index) if in_place is not None else None
    if cache is None:
        return None
    w = _weights(block, x)
    if w is None:
        return None
    kc, vc, starts = cache                                            # (B, n_kv, max_len, hd) x 2, (B,) int64
    a, n1, n2, (B, T, d) = block._modules["attn"], block._modules["attn_norm"], block._modules["ffn_norm"], x.shape
    H, n_kv, hd = a.n_heads, a.n_kv, a.hd
    if kc.shape[0] != B or kc.shape[-1] != hd or hd % 16 or hd > 256:
        return None
    x, y = x.contiguous(), torch.empty(B, T, d)
    if cos.dim() != 2:
        cos, sin = cos.reshape(-1, hd), sin.reshape(-1, hd)       # (B, 1, T, hd) -> (B T, hd)
    cos, sin = cos.contiguous(), sin.contiguous()
    rc = _call("block_layer",
        x.data_ptr(), y.data_ptr(), B * T, T, d, n1._parameters["weight"].data_ptr(), n1.eps, *w[0],
        cos.data_ptr(), sin.data_ptr(), cos.shape[0], H, n_kv, hd, kc.data_ptr(), vc.data_ptr(), kc.shape[2],
        starts.data_ptr(), n2._parameters["weight"].data_ptr(), n2.eps, *w[1], *w[2],
        block._modules["mlp"]._modules["w_gate_up"].out_features, *w[3], torch.get_num_threads())
    assert rc == 0, "block_layer: shapes past the C code's limits"
    return y
