"""The decode step's operators as first written, to measure what each rewrite in `model.py` and
`kv/contiguous.py` saves. Each is the same arithmetic, bit for bit, in more operators:

    "rope"    RoPE by chunk, negate and concatenate: cat([-x2, x1]) * sin    (now: roll, with the sign in sin)
    "split"   q, k, v by three slices of the fused product                    (now: two split calls)
    "cache"   K/V written and read by indexing the whole cache, [layer, :, :, s:s+T]
                                                                              (now: one view per layer, made once)

    with textbook(*names):   the step runs those operators the old way inside the block
    op_counts(fn)            {operator: calls} that Python makes in one call of fn()
"""
from __future__ import annotations

import collections
import contextlib

import torch

from .. import model as model_module
from ..kv.contiguous import KVCache
from .timing import _quiet_stderr

VARIANTS = ("rope", "split", "cache")


def _rope_tables(head_dim, positions, base, scaling=None):
    inv_freq = model_module.rope_inv_freq(head_dim, base, scaling)   # on the CPU, then moved: as first written
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()                        # sin without the sign


def _apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)                              # (B, heads, T, hd/2) each
    rotated = torch.cat([-x2, x1], dim=-1)                   # (B, heads, T, hd)
    return (x * cos + rotated * sin).to(x.dtype)


def _qkv(self, x, cos, sin):
    B, T, _ = x.shape
    H, n_kv, hd = self.n_heads, self.n_kv, self.hd
    qkv = self.wqkv(x).view(B, T, H + 2 * n_kv, hd).transpose(1, 2)
    qk = model_module.apply_rope(qkv[:, :H + n_kv], cos, sin)
    return qk[:, :H], qk[:, H:], qkv[:, H + n_kv:]


def _update(self, layer, k, v):
    T, s = self._T, self._starts[0]
    if not self._uniform or not isinstance(self.k, torch.Tensor):
        return KVCache.update(self, layer, k, v)             # the old form is measured on the common case
    self.k[layer, :, :, s:s + T] = k
    self.v[layer, :, :, s:s + T] = v
    end = max(self._starts) + T
    return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@contextlib.contextmanager
def textbook(*names: str):
    """Run the named parts of the step (see VARIANTS) as first written, until the block ends. The variants
    rewrite the plain model's PyTorch operators: time them on a model of the torch backend (a native model's
    blocks run in C and skip them)."""
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    saved = (model_module.rope_tables, model_module.apply_rope, model_module.Attention.qkv, KVCache.update)
    try:
        if "rope" in names:
            model_module.rope_tables, model_module.apply_rope = _rope_tables, _apply_rope
        if "split" in names:
            model_module.Attention.qkv = _qkv
        if "cache" in names:
            KVCache.update = _update
        yield
    finally:
        model_module.rope_tables, model_module.apply_rope, model_module.Attention.qkv, KVCache.update = saved


def op_counts(fn) -> collections.Counter:
    """The ATen operators Python calls in one fn() (not the ones they call inside), by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.cpu_parent is None and e.device_type.name == "CPU")
