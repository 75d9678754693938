"""The native backend's linear layers: the model's own layers with a faster product where one was measured
faster, and the layer's plain product everywhere else.

Each is a subclass of the plain layer that adds a fast path to `forward` and otherwise calls the plain one
(`super().forward`): the same parameters and buffers under the same names, so a prepared model's
state_dict is the plain model's.

    CLinear       nn.Linear without bias (float32 or bfloat16): up to `c_rows` rows in the C loop
                  (`matvec.matvec`); more rows through oneDNN's packed copy where one is kept (`packing`:
                  at 5-8 rows F.linear took 2-3x as long as the packed product); else F.linear
    CInt8Linear   Int8Linear: up to `c_rows` rows in C, from the int8 rows as stored
    CQ4Linear     Q4Linear: up to `c_rows` rows in C, from a copy of the codes in the C loop's tiles

`adopt(layer, ...)` turns a layer of a model copy (`backends.copy_modules`) into its C class in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.linear import Int8Linear, Q4Linear
from . import matvec, packed


def _c_takes(x: torch.Tensor, c_rows: int) -> int:
    """x's row count where a C loop takes x (a CPU tensor of float32 or bfloat16, at most c_rows rows, not
    under torch.compile), else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= c_rows and x.device.type == "cpu" and x.dtype in matvec.DTYPES
            and not torch.compiler.is_compiling()):
        return rows
    return 0


class CLinear(nn.Linear):
    c_rows: int = 0                          # up to this many rows go to the C loop (measured: races.py)
    packing: tuple | None = None             # (the weight's version when packed, its packed copy)

    @classmethod
    def adopt(cls, layer: nn.Linear, c_rows: int) -> "CLinear":
        layer.__class__, layer.c_rows, layer.packing = cls, c_rows, None
        return layer

    def pack(self) -> None:
        """Keep oneDNN's packed copy of the weight (a second copy of its bytes) for big steps."""
        w = self.weight
        if w.is_inference():
            raise ValueError("an inference tensor does not count its in-place writes: pack a weight made outside "
                             "torch.inference_mode")
        self.packing = (w._version, packed.pack(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = _c_takes(x, self.c_rows)
        grad = torch.is_grad_enabled() and w.requires_grad                 # autograd needs torch's operator
        if rows and x.dtype == w.dtype and self.in_features % 16 == 0 and w.is_contiguous() and not grad:
            return matvec.matvec(x.reshape(rows, -1).contiguous(), w).view(*x.shape[:-1], self.out_features)
        if self.packing is not None and x.dtype == w.dtype and x.device.type == "cpu":
            if self.packing[0] != w._version:                      # written in place since it was packed
                self.packing = None
            elif not torch.compiler.is_compiling() and not grad:
                return packed.product(x, self.packing[1])
        return F.linear(x, w)


class CInt8Linear(Int8Linear):
    c_rows: int = 0

    @classmethod
    def adopt(cls, layer: Int8Linear, c_rows: int) -> "CInt8Linear":
        layer.__class__, layer.c_rows = cls, c_rows
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _c_takes(x, self.c_rows)
        if rows and self.in_features % 16 == 0:
            y = matvec.matvec_int8(x.reshape(rows, -1).contiguous(), self.q, self.scale)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


class CQ4Linear(Q4Linear):
    c_rows: int = 0

    @classmethod
    def adopt(cls, layer: Q4Linear, c_rows: int) -> "CQ4Linear":
        """The layer with the C loop's copy of its codes, in tiles of 16 rows (`matvec.q4_tiles`); its rows
        must be a multiple of 16."""
        layer.__class__, layer.c_rows = cls, c_rows
        tiles = matvec.q4_tiles(layer.codes(), *layer.weight4().per_block())   # d, m per block of 32
        for name, t in zip(("c_tiles", "c_scale", "c_min"), tiles):
            layer.register_buffer(name, t, persistent=False)          # not saved: the format's codes are
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _c_takes(x, self.c_rows)
        if rows:                                                       # the format's values, in C
            y = matvec.matvec_q4_1(x.reshape(rows, -1).contiguous(), self.c_tiles, self.c_scale, self.c_min)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)
