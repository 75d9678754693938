"""The paged attention context: one step of stages 4 and 5 (the paged stage and the engine).

The new tokens of every sequence in the step are packed into **one flat sequence** of N tokens, no
padding; the model sees a batch of one. Linear layers do not care which sequence a token belongs to;
only attention does, and this context knows:

    slots            (N,)  where each token's K/V goes in the pool: page * block_size + offset
    q_lens, k_lens         per sequence: its new tokens, and the keys it attends to (cached + new)
    tables                 per sequence: its pages

In each layer it writes the new K/V to their slots, then attends each sequence's queries over its
pages, with one of two backends:

    "triton"   the kernels of `triton_paged.py`: they read pages in place through the block table
               (`decode_attention` when every sequence brings one token, else `flash_attn_varlen`)
    "cpu"      decodes read in place by a C kernel built on this machine (`cpu_kernel.py`), prefill
               chunks gathered for SDPA: the choice on a CPU for a model of the native backend (`backends/`)
               where a C compiler builds the kernel
    "torch"    gathered pages + SDPA (`paged_torch.py`): the choice for a plain model on a CPU
"""
from __future__ import annotations

import torch

from ..kv.paged import slot_of
from ..kv.quantized import QuantizedKV
from ..triton_support import require_triton
from .paged_torch import paged_attention, plan_paged_attention, workspace_for

BACKENDS = ("cpu", "torch", "triton")


def check_backend(backend: str, on_gpu: bool, what: str = "the triton attention backend", native: bool = False) -> str:
    """"auto" (triton on a GPU; on a CPU, cpu for a model of the native backend where its kernel builds, else
    torch), "cpu", "torch" or "triton" -> the backend; else ValueError. Triton where it is not installed:
    TritonUnavailable, naming `what` needs it; "cpu" where no compiler builds its kernel, or on a GPU:
    ValueError."""
    if backend == "auto":
        backend = "triton" if on_gpu else "cpu" if native and _kernel_builds() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention must be 'auto' or one of {BACKENDS}; got {backend!r}")
    if backend == "triton":
        require_triton(what)
    if backend == "cpu" and (on_gpu or not _kernel_builds()):
        raise ValueError("attention='cpu' needs the model on the CPU and a C compiler to build its kernel "
                         "(none worked here: use 'torch')")
    return backend


def _kernel_builds() -> bool:
    from . import cpu_kernel          # imported when asked for: a plain model's stages load no C code

    return cpu_kernel.available()


class PagedAttention:
    def __init__(self, pool, q_lens: list[int], k_lens: list[int], tables: list[list[int]],
                 backend: str = "torch", workspace: tuple = (None, None)):
        """q_lens[i] new tokens of sequence i end at key k_lens[i]; its pages are tables[i].
        workspace: the torch backend's gather buffers, kept by the runner from step to step."""
        self.pool, self.backend = pool, backend
        dev, bs = pool.device, pool.block_size
        slots = [slot_of(table, p, bs) for table, q, k in zip(tables, q_lens, k_lens) for p in range(k - q, k)]
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)                   # (N,)
        if backend in ("cpu", "torch"):
            if backend == "cpu":
                from . import cpu_kernel
            in_place = backend == "cpu" and cpu_kernel.supports(pool.k[0])   # int8/int4 or float16: gathered
            self.plan = plan_paged_attention(q_lens, k_lens, tables, bs, dev, in_place)
            self.workspace = tuple(workspace_for(self.plan, pool.k[0], w) for w in workspace)
            self.plan.workspace = self.workspace
            return
        from . import triton_paged

        self.kernels = triton_paged
        width = max(len(t) for t in tables)
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        self.k_lens = torch.tensor(k_lens, dtype=torch.int32, device=dev)
        self.decode = max(q_lens) == 1                                                    # one query each
        self.cu_q = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        self.cu_k = torch.tensor([0] + k_lens, device=dev).cumsum(0).to(torch.int32)
        self.max_q, self.max_k = max(q_lens), max(k_lens)

    def attend(self, layer: int, q, k, v):
        """q (1, H, N, hd); k, v (1, n_kv, N, hd), the step's new keys and values -> (1, H, N, hd)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]                  # (num_blocks, block_size, n_kv, hd)
        k, v, q = k[0].transpose(0, 1), v[0].transpose(0, 1), q[0].transpose(0, 1)   # (N, heads, hd)
        if self.backend == "triton" and not isinstance(kc, QuantizedKV):
            self.kernels.write_kv_to_slots(k.contiguous(), v.contiguous(), kc, vc, self.slots)
        else:                                                            # QuantizedKV: quantized as it is written
            kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slots, k)    # (slots, n_kv, hd)
            vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slots, v)
        if self.backend in ("cpu", "torch"):
            out = paged_attention(q, kc, vc, self.plan)                  # (N, H, hd)
        elif self.decode:
            out = self.kernels.decode_attention(q, kc, vc, self.k_lens, block_table=self.table,
                                                max_seqlen_k=self.max_k)
        else:
            out = self.kernels.flash_attn_varlen(q, kc, vc, self.cu_q, self.cu_k, self.max_q, self.max_k,
                                                 causal=True, block_table=self.table)
        return out.transpose(0, 1)[None]                                 # (1, H, N, hd)
