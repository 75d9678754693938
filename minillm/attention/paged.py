"""The paged attention context: one step of stages 4 and 5 (the paged stage and the engine).

The new tokens of every sequence in the step are packed into **one flat sequence** of N tokens, no
padding; the model sees a batch of one. Linear layers do not care which sequence a token belongs to;
only attention does, and this context knows:

    slots            (N,)  where each token's K/V goes in the pool: page * block_size + offset
    q_lens, k_lens         per sequence: its new tokens, and the keys it attends to (cached + new)
    tables                 per sequence: its pages

In each layer it writes the new K/V to their slots, then attends each sequence's queries over its
pages, through a paged-attention backend. Every backend is one file with one class and the same methods:

    plan(pool, q_lens, k_lens, tables) -> plan     once per step: what every layer reads the same way
    write(kc, vc, k, v, slots)                     this layer's new K/V into their slots
    attend(q, kc, vc, plan) -> out                 the packed queries over their pages
    captures; static_buffers, static_plan, fill    the hooks a CUDA graph needs (`cuda_graphs.py`):
                                                   fixed buffers, a plan over them to capture, a batch
                                                   written into them before each replay

    "triton"   `paged_triton.py`: the kernels of `triton_paged.py` read pages in place through the block
               table (`decode_attention` when every sequence brings one token, else `flash_attn_varlen`)
    "cpu"      `paged_cpu.py`: decodes read in place by a C kernel built on this machine
               (`cpu_kernel.py`), prefill chunks gathered for SDPA: the choice on a CPU for a model of
               the native backend (`backends/`) where a C compiler builds the kernel
    "torch"    `paged_torch.py`: gathered pages + SDPA: the choice for a plain model on a CPU

A backend object lives as long as the runner that made it (`make_backend`): the torch and cpu backends keep
their gather buffers in it from step to step.
"""
from __future__ import annotations

import importlib

import torch

from ..kv.paged import slot_of
from ..triton_support import require_triton

BACKENDS = {"cpu": "paged_cpu:CpuPaged", "torch": "paged_torch:TorchPaged", "triton": "paged_triton:TritonPaged"}


def check_backend(backend: str, on_gpu: bool, what: str = "the triton attention backend", native: bool = False) -> str:
    """"auto" (triton on a GPU; on a CPU, cpu for a model of the native backend where its kernel builds, else
    torch), "cpu", "torch" or "triton" -> the backend; else ValueError. Triton where it is not installed:
    TritonUnavailable, naming `what` needs it; "cpu" where no compiler builds its kernel, or on a GPU:
    ValueError."""
    if backend == "auto":
        backend = "triton" if on_gpu else "cpu" if native and _kernel_builds() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention must be 'auto' or one of {tuple(BACKENDS)}; got {backend!r}")
    if backend == "triton":
        require_triton(what)
    if backend == "cpu" and (on_gpu or not _kernel_builds()):
        raise ValueError("attention='cpu' needs the model on the CPU and a C compiler to build its kernel "
                         "(none worked here: use 'torch')")
    return backend


def _kernel_builds() -> bool:
    from . import cpu_kernel          # imported when asked for: a plain model's stages load no C code

    return cpu_kernel.available()


def make_backend(name: str):
    """A new backend object of a checked name (`check_backend`); its module is imported now."""
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)()


class PagedAttention:
    def __init__(self, pool, q_lens: list[int], k_lens: list[int], tables: list[list[int]], backend):
        """q_lens[i] new tokens of sequence i end at key k_lens[i]; its pages are tables[i]. backend: a
        backend object (`make_backend`), or a name for a new one."""
        self.pool = pool
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        bs = pool.block_size
        slots = [slot_of(table, p, bs) for table, q, k in zip(tables, q_lens, k_lens) for p in range(k - q, k)]
        self.slots = torch.tensor(slots, dtype=torch.long, device=pool.device)             # (N,)
        self.plan = self.backend.plan(pool, q_lens, k_lens, tables)

    @classmethod
    def static(cls, pool, backend, slots: torch.Tensor, plan) -> "PagedAttention":
        """A context over fixed buffers (a captured step: `backend.static_plan`)."""
        self = cls.__new__(cls)
        self.pool, self.backend, self.slots, self.plan = pool, backend, slots, plan
        return self

    def attend(self, layer: int, q, k, v):
        """q (1, H, N, hd); k, v (1, n_kv, N, hd), the step's new keys and values -> (1, H, N, hd)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]                  # (num_blocks, block_size, n_kv, hd)
        k, v, q = k[0].transpose(0, 1), v[0].transpose(0, 1), q[0].transpose(0, 1)   # (N, heads, hd)
        self.backend.write(kc, vc, k, v, self.slots)
        return self.backend.attend(q, kc, vc, self.plan).transpose(0, 1)[None]       # (1, H, N, hd)
