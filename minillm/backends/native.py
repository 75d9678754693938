"""The native backend on a CPU: a copy of the model's modules with the C layers swapped in, their kernels
chosen by the races of `races.py`, and what was chosen kept on the copy (`backend_report`).

    linear layers (float)     CLinear: the C loop up to the rows it won at, F.linear above, or oneDNN's
                              packed weights above where asked and faster
    int8 and Q4_1 layers      CInt8Linear, CQ4Linear: the C loop up to the rows it won at, torch's kernel above
    blocks                    CBlock: a decode's two halves around attention in one C call each, or the whole
                              block over a contiguous float32 cache (`c_block.py`)
    the tied output head      a CLinear over the embedding's weight (the biggest product of a decode step)
    the engine's attention    its "auto" paged attention reads decodes in place with the C kernel
                              (`attention/cpu_kernel.py`)

Where no C compiler works, the layers keep PyTorch's kernels (one line says so) and only the packed weights
remain to choose.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from ..attention import cpu_kernel
from ..quant.apply import LINEARS
from ..quant.linear import Int8Linear, Q4Linear
from . import c_block, matvec, packed, races
from .prepared import copy_modules
from .layers import CInt8Linear, CLinear, CQ4Linear


def _linears(model) -> list[nn.Module]:
    """The layers whose products a decode step makes: four per block and the output head."""
    layers = [getattr(getattr(b, part), name) for b in model.layers for part, name in LINEARS]
    return layers + ([model.lm_head] if "lm_head" in model._modules else [])


def _c_fits(m) -> bool:
    """Whether the C loop takes a quantized layer's shape: int8 rows of a multiple of 16 weights, Q4_1 tiles
    of 16 rows; on the CPU."""
    if isinstance(m, Int8Linear):
        return m.q.device.type == "cpu" and m.in_features % 16 == 0
    return m.packed.device.type == "cpu" and m.out_features % 16 == 0


def _rows_said(r: dict | None, other: str) -> str:
    if r is None:
        return f"{other} (no C loop built here)"
    ms = (f"1 row {r['c_ms_1']:.2f} ms against {r['torch_ms_1']:.2f}, 8 rows {r['c_ms_8']:.2f} against "
          f"{r['torch_ms_8']:.2f}{', remembered' if r.get('remembered') else ''}")
    if r["max_rows"] == 0:
        return f"{other} at every row count (the C loop was not faster by 5%: {ms})"
    return f"C loop up to {r['max_rows']} rows, {other} above ({ms})"


def prepare(model, pack_weights: bool = False, remember: bool = True):
    """The model's modules with the native backend's layers (see the module's docstring)."""
    fast = copy_modules(model)
    kernels = {}
    if model.cfg.tie_embeddings and "lm_head" not in fast._modules:       # the tied head as a layer of its own
        head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False, device="meta")
        head.weight = fast.tok_emb.weight                                   # the same Parameter
        fast.lm_head = head
    layers = _linears(fast)

    floats = [m for m in layers if type(m) is nn.Linear and m.bias is None and m.weight.device.type == "cpu"]
    for dtype in sorted({m.weight.dtype for m in floats if m.weight.dtype in matvec.DTYPES}, key=str):
        group = [m for m in floats if m.weight.dtype == dtype]
        r = races.float_products(dtype, remember)
        for m in group:
            CLinear.adopt(m, r["max_rows"] if r else 0)
        said = _rows_said(r, "F.linear")
        weights = [m.weight for m in group if not m.weight.is_inference()]
        if pack_weights and packed.available() and packed.packs(dtype) and weights:
            p = races.packed_products(weights, remember)
            if p["use_packed"]:
                for m in group:
                    m.pack()
            said += (f"; above the C loop's rows {'packed weights' if p['use_packed'] else 'F.linear'} "
                     f"(64 rows: packed {p['packed_ms']:.1f} ms against F.linear {p['torch_ms']:.1f})")
        kernels[f"{str(dtype).removeprefix('torch.')} products"] = {"chosen": said, "measured": r}

    for kind, plain, cls in (("int8", Int8Linear, CInt8Linear), ("q4_1", Q4Linear, CQ4Linear)):
        group = [m for m in layers if type(m) is plain and _c_fits(m)]
        if not group or model.dtype not in matvec.DTYPES:
            continue
        if matvec.load_library() is None:
            kernels[f"{kind} products"] = {"chosen": _rows_said(None, "torch's kernel"), "measured": None}
            continue
        group = [cls.adopt(m, 0) for m in group]
        r = races.quantized_products(kind, group, model.dtype, remember)
        for m in group:
            m.c_rows = r["max_rows"]
        kernels[f"{kind} products"] = {"chosen": _rows_said(r, "torch's kernel"), "measured": r}

    blocks = [b for b in fast.layers if c_block.fits(b)]
    if c_block.load_library() is not None and blocks:
        for block in blocks:
            c_block.CBlock.adopt(block)
        kernels["blocks"] = {"chosen": "one C call per half around attention (the whole block over a contiguous "
                                       "float32 cache) for float32 rows where every product runs in C",
                             "measured": None}
    kernels["paged attention"] = {
        "chosen": "decodes read in place by the C kernel" if cpu_kernel.available() else "gathered pages + SDPA",
        "measured": None}
    fast.__dict__.update(backend="native", plain=model,
                         backend_report={"backend": "native", "pack_weights": pack_weights, "kernels": kernels})
    return fast


def c_layers(model) -> list[nn.Module]:
    """The model's layers with a C product (`layers.py`)."""
    return [m for m in model.modules() if isinstance(m, (CLinear, CInt8Linear, CQ4Linear))]


@contextmanager
def settings(model, c_rows: int | None = None, blocks: bool | None = None):
    """Inside, on a model of the native backend: every C layer takes up to c_rows rows in C (matvec.MAX_ROWS:
    always, 0: never: torch's kernel for every product), and every block takes its C path (blocks=True) or
    runs its PyTorch operators (False); None leaves that as measured. Afterwards, as it was."""
    layers, cblocks = c_layers(model), [b for b in model.layers if isinstance(b, c_block.CBlock)]
    if model.__dict__.get("backend") != "native":
        raise ValueError("settings() changes a model of the native backend: apply_backend(model, 'native') first")
    if c_rows and matvec.load_library() is None:
        raise ValueError("no C compiler built the C loops here: there is no C product to turn on")
    kept = [m.c_rows for m in layers], [b.enabled for b in cblocks]
    try:
        for m in layers:
            m.c_rows = m.c_rows if c_rows is None else c_rows
        for b in cblocks:
            b.enabled = b.enabled if blocks is None else blocks
        yield model
    finally:
        for m, rows in zip(layers, kept[0]):
            m.c_rows = rows
        for b, on in zip(cblocks, kept[1]):
            b.enabled = on
