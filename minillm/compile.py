"""Regional compilation: the two halves of a block around attention, compiled once for all 30 layers.

A decode step of this small model runs about 1,600 operators (on the 4-bit file), each a call from
Python into ATen with its own dispatch cost, and only the matrix products among them do much work.
`torch.compile` traces a function into one graph and has inductor emit C++ for it: the norms, RoPE,
SiLU, the residual adds and the dtype conversions around a 4-bit kernel become a few fused loops, and
the matrix products stay calls to the same kernels as before.

What is compiled is `Block.before_attention` (RMSNorm, the Q/K/V product, RoPE) and
`Block.after_attention` (the output product, the residual, RMSNorm, the MLP), not the whole model:

    one compile serves every layer   the 30 blocks run the same code on different weights; the weights
                                     are the graph's inputs, not constants baked into it
    attention stays outside          each stage's attention context (a contiguous cache, a paged pool,
                                     a Triton kernel) runs eagerly, as it is; no stage needs a compiled
                                     variant of its own
    shapes are dynamic               one graph for any number of tokens (a length of 1, a decode step,
                                     is its own graph: torch specialises sizes 0 and 1)

    compile_blocks(model)   compiles in place (the first step after it pays for compiling); returns model
    eager_blocks(model)     back to eager
    is_compiled(model)

Compiling takes seconds per graph on first use; inductor caches what it built on disk
(`torch._inductor` FX graph cache, under the system's temp directory), so a second process starts fast.
The compiled code does the same float arithmetic in a different order (fused loops): logits agree with
eager to float32 rounding, and greedy tokens match (tests).
"""
from __future__ import annotations

import functools

import torch

from .model import Block

RECOMPILE_LIMIT = 32    # graphs per half: one per model type (float, each quantized format) and length class

_compiled: dict[str, object] = {}


def _half(name: str):
    """The compiled Block.<name>, one for every model (its cache of graphs is shared)."""
    if name not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _compiled[name] = torch.compile(getattr(Block, name), dynamic=True)
    return _compiled[name]


def compile_blocks(model):
    """Compile both halves of every block of `model` (in place); returns the model."""
    for block in model.layers:
        for name in ("before_attention", "after_attention"):
            setattr(block, name, functools.partial(_half(name), block))   # shadows the eager method
    return model


def eager_blocks(model):
    """Undo compile_blocks: every block runs its eager methods again."""
    for block in model.layers:
        for name in ("before_attention", "after_attention"):
            block.__dict__.pop(name, None)
    return model


def is_compiled(model) -> bool:
    return "before_attention" in model.layers[0].__dict__
