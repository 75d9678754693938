"""A block's two halves around attention in one C call each, for a decode's few rows (`c_block.c`), or the
whole block in one call where C can write and read the attention context's cache itself.

`Block.before_attention` (RMSNorm, the Q/K/V product, RoPE) and `Block.after_attention` (the output product,
the residual, RMSNorm, the SwiGLU MLP, the residual) run about 35 PyTorch operators per layer; for one row
of activations each does a few microseconds of work and costs a few more to dispatch. Here each half is one
call into C, with the products of `matvec.c` in each weight's own format. Attention stays in Python, with
the stage's attention context, so every stage can use it. Where the context is stage 2's contiguous cache
in float32 with causal SDPA (`CachedAttention.in_place`), `layer` does the whole block, cache write and
attention included, in one call: about 30 dispatches of Python per layer become one.

The native backend makes a model's blocks `CBlock`s (`adopt`): a block takes the C path when its
activations are float32 rows on a CPU, at most `matvec.MAX_ROWS` of them, every weight is a C layer of the
native backend (`layers.py`: float32, int8 rows or Q4_1 blocks), and each of them takes that many rows in C
(their `c_rows`, measured when the backend was applied). `enabled = False` on a block turns it off: the
same products in C, the other operators in PyTorch (to compare).

The arithmetic is the same in float32, in another order: logits agree to rounding, greedy tokens match (tests).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from .. import cbuild
from ..model import Block
from . import matvec
from .layers import CInt8Linear, CLinear, CQ4Linear

SOURCE = Path(__file__).with_name("c_block.c")
PROFILER_NAME = "minillm::c_block"     # what torch.profiler sees: the products, with the norms, RoPE and SiLU
LAYER_PROFILER_NAME = "minillm::c_layer"   # a whole block: the same, with the cache write and attention
W_FLOAT32, W_INT8, W_Q4_1 = 0, 2, 3


def _weight(name: str, rows: str | None) -> list[tuple[str, str]]:
    """A weight's C arguments: its kind, three tensors' data, and (when given) its row count."""
    return [(f"{name}_kind", "i32"), (f"{name}_a", "ptr"), (f"{name}_b", "ptr"), (f"{name}_c", "ptr")] + (
        [(rows, "i64")] if rows else [])


_ROPE = [("cos", "ptr"), ("sin", "ptr"), ("table_rows", "i32")]
SIGNATURES = {
    "block_before": [("x", "ptr"), ("m", "i32"), ("T", "i32"), ("d", "i32"), ("gain", "ptr"), ("eps", "f32"),
                     *_weight("qkv", "N"), *_ROPE, ("rot_heads", "i32"), ("hd", "i32"), ("out", "ptr"),
                     ("threads", "i32")],
    "block_after": [("x0", "ptr"), ("x", "ptr"), ("out", "ptr"), ("so_b", "i64"), ("so_h", "i64"), ("so_t", "i64"),
                    ("T", "i32"), ("hd", "i32"), ("m", "i32"), ("d", "i32"), ("gain", "ptr"), ("eps", "f32"),
                    *_weight("o", None), ("Ko", "i32"), *_weight("gu", "ffn2"), *_weight("down", None),
                    ("threads", "i32")],
    "block_layer": [("x", "ptr"), ("y", "ptr"), ("m", "i32"), ("T", "i32"), ("d", "i32"), ("gain1", "ptr"),
                    ("eps1", "f32"), *_weight("qkv", None), *_ROPE, ("H", "i32"), ("n_kv", "i32"), ("hd", "i32"),
                    ("kc", "ptr"), ("vc", "ptr"), ("max_len", "i64"), ("starts", "ptr"), ("gain2", "ptr"),
                    ("eps2", "f32"), *_weight("o", None), *_weight("gu", "ffn2"), *_weight("down", None),
                    ("threads", "i32")],
}


@lru_cache(maxsize=1)
def load_library() -> cbuild.Library | None:
    return cbuild.load(SOURCE, SIGNATURES)


def _call(name: str, **args) -> int:
    lib = load_library()
    if torch.autograd.profiler._is_profiler_enabled:              # seen by torch.profiler as one operator
        with torch.profiler.record_function(LAYER_PROFILER_NAME if name == "block_layer" else PROFILER_NAME):
            return lib.call(name, **args)
    return lib.call(name, **args)


def _describe(layer) -> tuple | None:
    """(kind, a, b, c): a layer's weight as the C code takes it, or None where it has no C product."""
    if type(layer) is CLinear and layer.weight.dtype == torch.float32 and layer.in_features % 16 == 0:
        return W_FLOAT32, layer.weight.data_ptr(), None, None
    if type(layer) is CInt8Linear and layer.in_features % 16 == 0:
        return W_INT8, layer.q.data_ptr(), layer.scale.data_ptr(), None
    if type(layer) is CQ4Linear:
        return W_Q4_1, layer.c_tiles.data_ptr(), layer.c_scale.data_ptr(), layer.c_min.data_ptr()
    return None


def _args(name: str, described: tuple) -> dict:
    return dict(zip((f"{name}_kind", f"{name}_a", f"{name}_b", f"{name}_c"), described))


def _weights(block, x: torch.Tensor) -> dict | None:
    """The block's four weights as C arguments ({"before": the Q/K/V product's, "after": the other three's,
    "layer": all four's}), or None where the block does not take the C path for x.
    Described once per block and kept, again if a layer or its weight tensor is replaced. (This runs twice
    per layer per step, so it reads `_modules`, `_parameters` and `_buffers` directly and checks what it
    kept with plain identity tests: `block.attn.wqkv` costs a microsecond or two per step of the chain.)"""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or not block.enabled:
        return None
    rows = x.numel() // x.shape[-1]
    if (x.dtype != torch.float32 or not 0 < rows <= matvec.MAX_ROWS or torch.is_grad_enabled()
            or load_library() is None):
        return None
    kept = block.__dict__.get("_c_weights")
    if kept is None or not _unchanged(kept[0]):
        attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]._modules
        layers = (attn["wqkv"], attn["wo"], mlp["w_gate_up"], mlp["w_down"])
        found = [_describe(layer) for layer in layers]
        args = None
        if None not in found:
            q, o, gu, down = (_args(name, w) for name, w in zip(("qkv", "o", "gu", "down"), found))
            args = {"before": q, "after": o | gu | down, "layer": q | o | gu | down}
        kept = (_checks(block, layers), args, layers)
        block.__dict__["_c_weights"] = kept
    _, args, layers = kept
    if args is None:
        return None
    for layer in layers:                                # measured per layer when the backend was applied
        if rows > layer.c_rows:
            return None
    return args


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


def _rope_rows(cos: torch.Tensor, sin: torch.Tensor, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as (rows, hd) contiguous tables: row i of x turns by row i % rows."""
    if cos.dim() != 2:
        cos, sin = cos.reshape(-1, hd), sin.reshape(-1, hd)       # (B, 1, T, hd) -> (B T, hd)
    return cos.contiguous(), sin.contiguous()


def fits(block) -> bool:
    """Whether the C block computes this block: Llama's attention (no QKV bias, no per-head q/k norms)."""
    attn = block._modules["attn"]
    return getattr(attn._modules["wqkv"], "bias", None) is None and "q_norm" not in attn._modules


def before_attention(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Block.before_attention in one call: x (B, T, d) -> q (B, H, T, hd), k and v (B, n_kv, T, hd);
    None where the block does not take the C path (the caller runs its own)."""
    w = _weights(block, x)
    if w is None:
        return None
    a, norm, (B, T, d) = block._modules["attn"], block._modules["attn_norm"], x.shape
    H, n_kv, hd = a.n_heads, a.n_kv, a.hd
    x = x.contiguous()
    cos, sin = _rope_rows(cos, sin, hd)
    qkv = torch.empty(B, H + 2 * n_kv, T, hd)                    # written head-major: q, k, v are views
    rc = _call("block_before", x=x.data_ptr(), m=B * T, T=T, d=d, gain=norm._parameters["weight"].data_ptr(),
               eps=norm.eps, **w["before"], N=qkv.shape[1] * hd, cos=cos.data_ptr(), sin=sin.data_ptr(),
               table_rows=cos.shape[0], rot_heads=H + n_kv, hd=hd, out=qkv.data_ptr(), threads=torch.get_num_threads())
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
    rc = _call("block_after", x0=x.data_ptr(), x=y.data_ptr(), out=out.data_ptr(), so_b=so[0], so_h=so[1],
               so_t=so[2], T=T, hd=out.shape[3], m=B * T, d=d, gain=norm._parameters["weight"].data_ptr(),
               eps=norm.eps, **w["after"], Ko=out.shape[1] * out.shape[3], ffn2=gate_up.out_features,
               threads=torch.get_num_threads())
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
    cos, sin = _rope_rows(cos, sin, hd)
    rc = _call("block_layer", x=x.data_ptr(), y=y.data_ptr(), m=B * T, T=T, d=d,
               gain1=n1._parameters["weight"].data_ptr(), eps1=n1.eps, **w["layer"], cos=cos.data_ptr(),
               sin=sin.data_ptr(), table_rows=cos.shape[0], H=H, n_kv=n_kv, hd=hd, kc=kc.data_ptr(),
               vc=vc.data_ptr(), max_len=kc.shape[2], starts=starts.data_ptr(),
               gain2=n2._parameters["weight"].data_ptr(), eps2=n2.eps,
               ffn2=block._modules["mlp"]._modules["w_gate_up"].out_features, threads=torch.get_num_threads())
    assert rc == 0, "block_layer: shapes past the C code's limits"
    return y


class CBlock(Block):
    """A block whose decode steps run in one or two C calls where they can (see the module's docstring), and
    as the plain block everywhere else."""

    enabled: bool = True

    @classmethod
    def adopt(cls, block: Block) -> "CBlock":
        block.__class__, block.enabled = cls, True
        return block

    def forward(self, x, cos, sin, attn, layer_index=0):
        fused = layer(self, x, cos, sin, attn, layer_index)           # a decode's few rows, a cache C can read
        return super().forward(x, cos, sin, attn, layer_index) if fused is None else fused

    def before_attention(self, x, cos, sin):
        fused = before_attention(self, x, cos, sin)                   # a decode's few rows: one C call
        return super().before_attention(x, cos, sin) if fused is None else fused

    def after_attention(self, x, out):
        fused = after_attention(self, x, out)
        return super().after_attention(x, out) if fused is None else fused
