"""CUDA graphs for decode steps: record a step's kernel launches once, then replay them.

A decode step of a 135M model on a GPU is bound by launches, not by bytes: about 100 small kernels a
layer, 30 layers, each a few microseconds of work after microseconds of Python and driver time. A CUDA
graph records the whole step on its first run and replays it with one call. Every tensor the step
touches must then sit at a fixed address with a fixed shape, so the step reads static buffers that are
refilled before each replay. Two steps are captured:

`DecodeGraphs`, the engine's decode-only steps (paged KV cache, any mix of requests):

    ids, positions   (S,)     one token per sequence, and its position
    attention's      what the paged-attention backend reads (`static_buffers`; the triton backend's:
                     slots (S,), -1 for a padding row; keys per row (S,), 0 for padding; tables (S, W),
                     W = the pages of the longest context), written before each replay (`fill`)

  A graph is captured for each size of a ladder (1, 2, 4, 8, then every 16, as nano-vllm does); a batch
  of n runs in the smallest size >= n, its extra rows padded.

`ContiguousDecodeGraph`, the flash stage's decode step (one contiguous cache, its B sequences fixed by
the prefill): ids, positions and key counts (B,).

The decode kernel's number of key slices is fixed per graph (each sequence cuts its own keys into that
many slices, `triton_flash.decode_attention`). `eager=True` (`--enforce-eager`) runs the same static
step without capturing it: the same inputs, the same kernels, launched one by one. That is also how
the step runs on a CPU, where there are no graphs.
"""
from __future__ import annotations

from bisect import bisect_left

import torch

from .attention.paged import PagedAttention


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to the first that holds max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(16 if sizes[-1] < 16 else sizes[-1] + 16)
    return sizes[:bisect_left(sizes, max_batch) + 1]


def padded_size(n: int, sizes: list[int]) -> int:
    """The smallest captured size that holds a batch of n."""
    i = bisect_left(sizes, n)
    if n < 1 or i == len(sizes):
        raise ValueError(f"a decode batch of {n} does not fit the captured sizes (1 to {sizes[-1]})")
    return sizes[i]


class DecodeGraphs:
    def __init__(self, model, pool, max_batch: int, max_len: int, eager: bool = False, backend=None):
        """Static buffers for decode batches of up to max_batch sequences with contexts of up to max_len
        tokens; on a GPU, unless eager, one graph captured per size of `capture_sizes(max_batch)`.
        backend: the paged-attention backend object whose hooks make the step static (default: triton's)."""
        from .attention.paged import make_backend
        from .attention.triton_flash import default_num_splits      # triton: imported on first use

        self.backend = backend or make_backend("triton")
        if not self.backend.captures:
            raise ValueError(f"the {self.backend.name} attention backend has no static decode step to capture")
        self.model, self.pool = model, pool
        self.sizes = capture_sizes(max_batch)
        self.eager = eager or pool.device.type != "cuda"
        S, dev = self.sizes[-1], pool.device
        self.width = -(-max_len // pool.block_size)                        # W: pages of the longest context
        self.ids = torch.zeros(S, dtype=torch.long, device=dev)
        self.positions = torch.zeros(S, dtype=torch.long, device=dev)
        self.buffers = self.backend.static_buffers(S, self.width, dev)    # what attention reads: slots, tables
        self.splits = {n: default_num_splits(n, model.cfg.n_kv_heads, max_len, 64, dev) for n in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if not self.eager:
            self._capture()

    def _step(self, size: int) -> torch.Tensor:
        """The decode step over the first `size` rows of the buffers -> logits (size, vocab)."""
        attn = PagedAttention.static(self.pool, self.backend, *self.backend.static_plan(self.buffers, size,
                                                                                        self.splits[size]))
        return self.model(self.ids[None, :size], self.positions[:size], attn)[0]

    @torch.inference_mode()
    def _capture(self) -> None:
        memory = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):           # the largest first: the smaller ones reuse its memory
            self._step(size)                         # warm-up: Triton compiles, allocations settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                out = self._step(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def fill(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> int:
        """Write one decode batch into the buffers, padded to its captured size; returns that size.
        tokens[i] goes to position positions[i] of the sequence whose pages are tables[i]."""
        n, bs = len(tokens), self.pool.block_size
        size = padded_size(n, self.sizes)
        if any(len(t) > self.width for t in tables):
            raise ValueError(f"a context longer than the {self.width * bs} tokens the graphs were sized for")
        pad = size - n
        self.ids[:size].copy_(torch.tensor(tokens + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.backend.fill(self.buffers, tables, positions, size, bs)
        return size

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: logits (n, vocab), a view of a buffer the next step overwrites."""
        size = self.fill(tokens, positions, tables)
        if self.eager:
            out = self._step(size)
        else:
            graph, out = self.graphs[size]
            graph.replay()
        return out[:len(tokens)]


class StaticContiguousDecode:
    """The flash stage's attention context for a static decode step: each sequence's one new token is
    written at its position of the contiguous cache, then the decode kernel reads its keys."""

    def __init__(self, cache, rows, positions, seqlens, num_splits: int):
        from .attention import triton_flash

        self.kernels, self.cache = triton_flash, cache
        self.rows, self.positions, self.seqlens, self.num_splits = rows, positions, seqlens, num_splits

    def attend(self, layer: int, q, k, v):
        """q (B, H, 1, hd); k, v (B, n_kv, 1, hd) -> (B, H, 1, hd)."""
        k_all, v_all = self.cache._layers[layer]                          # (B, n_kv, max_len, hd)
        k_all[self.rows, :, self.positions] = k[:, :, 0]                  # (B, n_kv, hd) at (b, :, position b)
        v_all[self.rows, :, self.positions] = v[:, :, 0]
        out = self.kernels.decode_attention(q[:, :, 0], k_all.permute(0, 2, 1, 3), v_all.permute(0, 2, 1, 3),
                                            self.seqlens, num_splits=self.num_splits)   # (B, H, hd)
        return out[:, :, None]


class ContiguousDecodeGraph:
    def __init__(self, model, cache, eager: bool = False):
        """The decode step of the B sequences in `cache` (a float `KVCache`): on a GPU, unless eager,
        captured on its first run, which also computes that step's logits."""
        from .attention.triton_flash import default_num_splits     # triton: imported on first use

        B, dev = len(cache.lengths), model.device
        self.model, self.cache = model, cache
        self.eager = eager or dev.type != "cuda"
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.seqlens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.rows = torch.arange(B, device=dev)
        self.splits = default_num_splits(B, model.cfg.n_kv_heads, cache.max_len, 64, dev)
        self.graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None

    def _step(self) -> torch.Tensor:
        attn = StaticContiguousDecode(self.cache, self.rows, self.positions, self.seqlens, self.splits)
        return self.model(self.ids, self.positions[:, None], attn)[:, -1]             # (B, vocab)

    @torch.inference_mode()
    def run(self, tokens: list[int]) -> torch.Tensor:
        """tokens[b] after what sequence b holds -> logits (B, vocab), a buffer the next step overwrites.
        The cache's lengths are the caller's to commit, as after any step."""
        lengths = self.cache.lengths
        if max(lengths) >= self.cache.max_len:
            raise ValueError(f"KV cache full: {max(lengths) + 1} tokens needed, {self.cache.max_len} allocated")
        self.ids.copy_(torch.tensor(tokens)[:, None], non_blocking=True)
        self.positions.copy_(torch.tensor(lengths), non_blocking=True)
        self.seqlens.copy_(torch.tensor([n + 1 for n in lengths], dtype=torch.int32), non_blocking=True)
        if self.eager:
            return self._step()
        if self.graph is None:                      # the first step runs for real, then is recorded
            logits = self._step().clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._step()
            self.graph = (graph, out)
            return logits
        graph, out = self.graph
        graph.replay()
        return out
