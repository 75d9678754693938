"""The "cpu" paged-attention backend: the "torch" backend's plan and gathers for prefill chunks, but decodes
(and chunks of a few queries, one decode per query: a speculative step's drafts) read in place by the C
kernel built on this machine (`cpu_kernel.py`, `cpu_paged.c`), through their block tables, the way the
Triton decode kernel reads them on a GPU. A cache the kernel cannot read (int8 or int4
K/V, float16) is gathered as by "torch".
"""
from __future__ import annotations

from . import cpu_kernel
from .paged_torch import TorchPaged


class CpuPaged(TorchPaged):
    name = "cpu"

    def _in_place(self, pool) -> bool:
        return cpu_kernel.supports(pool.k[0])
