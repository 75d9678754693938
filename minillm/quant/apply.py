"""Quantize a loaded model in place: every linear layer, the output head and the embedding.

    quantize_model(model, "int8")        weight-only int8, one scale per output row
    quantize_model(model, "w8a8")        int8 weights and activations (per token), SmoothQuant scales
    quantize_model(model, "q4")          4-bit groups of 64 (Q4_GROUP; 32 in a row of 64k + 32 weights),
                                         quantized here from the loaded weights
    quantize_model(model, "q4_file")     the GGUF file's own Q4_1 blocks, bit for bit (no re-quantizing)

The output head (the embedding matrix, tied) is kept at 8 bits in every format, as llama.cpp keeps it:
it is the layer whose errors reach the logits directly. The embedding lookup reads the same int8 rows.
Where the head's kernel gives bfloat16 logits, its top few are recomputed in float32 (`Int8Linear.rescore`),
so that near-ties are decided as a float32 head would decide them.

On a CPU, the native backend (`backends/`) gives the int8 and Q4_1 layers C loops for a decode's few rows,
where they measure faster; quantize first, then apply the backend.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from .gguf_blocks import Q4Weight, read_q4_1
from .linear import Int8Linear, Q4Linear, W8A8Linear

FORMATS = ("int8", "w8a8", "q4", "q4_file")
Q4_GROUP = 64       # "q4": weights per scale and minimum. Not the file's 32, so that "q4" rounds these weights
                    # (the file's, already on a grid of 32) onto another grid, as quantizing a 16-bit model would
RESCORE_TOP = 8     # the int8 head's largest logits recomputed in float32 (Int8Linear.rescore)
LINEARS = (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


class Int8Embedding(nn.Module):
    """Embedding lookup from an int8 table with one scale per row (the quantized head's weight)."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, scale = self.table.q[ids], self.table.scale[ids]        # (..., d) int8, (...,)
        return (q.float() * scale[..., None]).to(self.dtype)       # (..., d)


def check_format(quant: str | None) -> None:
    if quant is not None and quant not in FORMATS:
        raise ValueError(f"unknown quantization {quant!r}: choose one of {', '.join(FORMATS)} (or none)")


@torch.inference_mode()
def quantize_model(model, quant: str, path: str | Path | None = None, smooth: dict | None = None,
                   progress: bool | None = None):
    """Replace the model's linear layers by `quant`'s (in place); returns the model.

    path: the GGUF file, for "q4_file" (default: the course model).
    smooth: for "w8a8", SmoothQuant scales {"layers.{i}.{attn|mlp}.{name}": (in,)} (see smoothquant.py);
        default: none, plain per-token int8.
    """
    check_format(quant)
    if model.__dict__.get("backend", "torch") != "torch":
        raise ValueError("quantize the plain model, then apply the backend (backends.apply_backend)")
    if model.quant:
        raise ValueError(f"the model is already quantized ({model.quant}); load it again to change format")
    if model.cfg.qkv_bias:
        raise ValueError("this model's Q/K/V projection has a bias, and minillm's quantized layers have none: "
                         "run it unquantized")
    device = model.device
    file_weights = _file_q4_weights(model.cfg, path) if quant == "q4_file" else None
    for i, block in enumerate(tqdm(model.layers, desc=f"quantizing ({quant})", unit="layer",
                                   disable=progress is False or None, leave=False)):
        for part, name in LINEARS:
            parent, key = getattr(block, part), f"layers.{i}.{part}.{name}"
            w = getattr(parent, name).weight
            if quant == "int8":
                layer = Int8Linear.from_float(w)
            elif quant == "w8a8":
                layer = W8A8Linear(w, smooth.get(key) if smooth else None)
            elif quant == "q4":
                layer = Q4Linear.from_float(w, device, Q4_GROUP if w.shape[1] % Q4_GROUP == 0 else 32)
            else:
                layer = Q4Linear(file_weights[key], device)
            setattr(parent, name, layer.to(device))
    w_out = model.lm_head.weight if "lm_head" in model._modules else model.tok_emb.weight
    head = W8A8Linear(w_out) if quant == "w8a8" else Int8Linear.from_float(w_out)
    if isinstance(head, Int8Linear):
        head.rescore_top = RESCORE_TOP
    model.lm_head = head.to(device)
    if model.cfg.tie_embeddings:   # the lookup shares the head's int8 table: no float copy left
        model.tok_emb = Int8Embedding(head.int8 if quant == "w8a8" else head, model.dtype)
    model.quant = quant
    return model


def _file_q4_weights(cfg, path) -> dict[str, Q4Weight]:
    """The file's Q4_1 weights under minillm's fused names: wqkv = [wq; wk; wv], w_gate_up = [gate; up]."""
    from ..weights import find_model, gguf_reader, unpermute_rope_rows

    path = find_model(path)
    if path.is_dir() or path.suffix != ".gguf":
        raise ValueError(f"quant='q4_file' reads 4-bit blocks from a GGUF file; {path} is not one")
    tensors = {t.name: t for t in gguf_reader(path.resolve()).tensors}

    def read(name: str, rope_heads: int | None = None) -> Q4Weight:
        if name not in tensors:
            raise ValueError(f"{path.name} has no tensor {name}")
        w = read_q4_1(tensors[name])   # ValueError if the file stores it in another format
        if rope_heads:                 # undo llama.cpp's RoPE row order, as weights.py does
            w = w.permute_rows(unpermute_rope_rows(torch.arange(w.shape[0]), rope_heads))
        return w

    def cat(ws: list[Q4Weight]) -> Q4Weight:
        return Q4Weight(*(torch.cat([getattr(w, f) for w in ws]) for f in ("packed", "scale", "min")))

    out = {}
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        out[f"layers.{i}.attn.wqkv"] = cat([read(b + "attn_q.weight", cfg.n_heads),
                                            read(b + "attn_k.weight", cfg.n_kv_heads), read(b + "attn_v.weight")])
        out[f"layers.{i}.attn.wo"] = read(b + "attn_output.weight")
        out[f"layers.{i}.mlp.w_gate_up"] = cat([read(b + "ffn_gate.weight"), read(b + "ffn_up.weight")])
        out[f"layers.{i}.mlp.w_down"] = read(b + "ffn_down.weight")
    return out
