"""Stage 3: FlashAttention in Triton — exact attention without the score matrix.

Two kernels, with the conventions of the flash-attn package so the two can be compared:

    flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)
        prefill: sequences packed one after another, q (total_q, H, D), k and v (total_k, H_kv, D);
        a sequence's keys may be longer than its queries (a cached prefix), causal alignment bottom-right.
    decode_attention(q, k_cache, v_cache, cache_seqlens)
        one query per sequence, q (B, H, D), against a contiguous cache (B, max_len, H_kv, D), split along
        the keys (flash-decoding) so a long context keeps many programs busy, then a small reduction kernel.

The idea (see tiled.py for the same math in plain PyTorch): walk over the keys in tiles of BLOCK_N,
keep for each query row a running max m, a running sum l and an unnormalized output acc, and rescale
them when a new tile raises the max. The T x S score matrix never exists; each program holds a
BLOCK_M x BLOCK_N tile of it in registers.

Memory traffic (HBM bytes, e = bytes per element, D head dim, per (sequence, head)):
    naive: writes and reads the T x S scores and probabilities: ~4 T S e on top of Q, K, V, O
    flash: reads Q and writes O once (2 T D e), reads K and V once per BLOCK_M rows of queries
           (2 S D e x T / BLOCK_M), never touches T x S.

Triton compiles a kernel for each set of its constexpr values and, unless told otherwise, for each kind of
integer argument it sees (equal to 1, a multiple of 16, other). Arguments that change from one engine step
to the next (a block table's width, the number of key slices) are marked `do_not_specialize`: each kernel
compiles once, at warm-up, and never in the middle of a request.

On a CPU these kernels run through the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported): same code, executed with numpy, slow but exact. On a GPU they compile.
"""
from __future__ import annotations

import functools
import math

import torch

from ..triton_support import require_triton

require_triton("stage 3 (the FlashAttention kernels)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the GPU's native instruction


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of the online softmax. s: (rows, BLOCK_N) scores in log2 units, masked ones -inf;
    v: (BLOCK_N, D). Returns the running max, sum and unnormalized output after this tile."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # a row that sees nothing yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)                                   # rescale what came before
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_kv(X, X_s, x_off, s_off, row_ok, d_ok, offs_d, BITS: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) tile of cached keys or values, float32 (or the cache's float dtype).
    x_off, s_off (BLOCK_N,): where each row's values and scales start. BITS 0: a float cache;
    8: int8 codes times the row's scale; 4: two 4-bit codes per byte (value 2j low, 2j + 1 high),
    w = q d + m with d, m per group of 32 values (`kv/quantized.py`)."""
    mask = row_ok[:, None] & d_ok[None, :]
    if BITS == 8:
        q = tl.load(X + x_off[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.float32)
        s = tl.load(X_s + s_off, mask=row_ok, other=0.0).to(tl.float32)
        return q * s[:, None]
    elif BITS == 4:
        b = tl.load(X + x_off[:, None] + (offs_d // 2)[None, :], mask=mask, other=0)   # each byte twice
        q = tl.where((offs_d % 2 == 0)[None, :], b & 0x0F, b >> 4).to(tl.float32)
        dm = s_off[:, None] + 2 * (offs_d // 32)[None, :]                              # (d, m) of the group
        d = tl.load(X_s + dm, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(X_s + dm + 1, mask=mask, other=0.0).to(tl.float32)
        return q * d + m
    else:
        return tl.load(X + x_off[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, lo, hi, K, V, K_s, V_s, block_table, s_bt, seq, k_start, k_len, kv_head,
                  offs_m, offset, sk_t, sk_h, sv_t, sv_h, ss_t, ss_h, scale_log2,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                  IEEE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, KV_BITS: tl.constexpr,
                  MASKED: tl.constexpr = False):
    """The prefill kernel's walk over key tiles [lo, hi) for one block of queries. MASKED: scores of keys
    past k_len (and, if CAUSAL, past each query's own position) are set to -inf; unmasked tiles skip that."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if PAGED:  # key j of this sequence lives in page block_table[seq, j // PAGE], at row j % PAGE
            page = tl.load(block_table + seq * s_bt + cols // PAGE, mask=cols < k_len, other=0)
            rows = page * PAGE + cols % PAGE
        else:      # packed: the sequence's keys follow one another from k_start
            rows = k_start + cols
        # Read a K tile and a V tile: 2 x BLOCK_N x D x e bytes (quantized: D or D / 2 bytes a row, + scales).
        row_ok = cols < k_len
        s_off = rows * ss_t + kv_head * ss_h
        k = _load_kv(K, K_s, rows * sk_t + kv_head * sk_h, s_off, row_ok, d_ok, offs_d, KV_BITS).to(q.dtype)
        v = _load_kv(V, V_s, rows * sv_t + kv_head * sv_h, s_off, row_ok, d_ok, offs_d, KV_BITS).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2                                                    # (BLOCK_M, BLOCK_N), in registers only
        if MASKED:
            visible = cols[None, :] < k_len
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + offset)
            s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["s_bt"])
def _flash_fwd_kernel(
    Q, K, V, O, cu_q, cu_k, scale_log2, block_table, s_bt,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,       # strides (the last dim is contiguous)
    K_s, V_s, ss_t, ss_h,                                 # scales of a quantized cache (KV_BITS 8 or 4)
    D: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, KV_BITS: tl.constexpr,
):
    # One program: BLOCK_M queries of one sequence, one query head.
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    k_start = tl.load(cu_k + seq)
    k_len = tl.load(cu_k + seq + 1) - k_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_head = head // GROUP                        # GQA: read the shared KV head, never a copy
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # Read the Q tile once: BLOCK_M x D x e bytes.
    q = tl.load(Q + (q_start + offs_m)[:, None] * sq_t + head * sq_h + offs_d[None, :],
                mask=(offs_m[:, None] < q_len) & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)        # running sum of probabilities x V
    # Bottom-right causal: query i sits at key position i + (k_len - q_len).
    offset = k_len - q_len
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (m_block + 1) * BLOCK_M + offset)     # tiles wholly above the diagonal: skipped
        first = tl.maximum(m_block * BLOCK_M + offset + 1, 0)        # keys the block's first query sees
        lo = tl.minimum(first // BLOCK_N * BLOCK_N, hi)
    else:
        lo = k_len // BLOCK_N * BLOCK_N
    # Tiles [0, lo): every query of the block sees every key, so no mask is computed. Tiles [lo, hi): the
    # diagonal (and the last partial tile), masked.
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, 0, lo, K, V, K_s, V_s, block_table, s_bt, seq, k_start,
                                  k_len, kv_head, offs_m, offset, sk_t, sk_h, sv_t, sv_h, ss_t, ss_h, scale_log2,
                                  D, BLOCK_N, BLOCK_D, False, IEEE, PAGED, PAGE, KV_BITS)
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, lo, hi, K, V, K_s, V_s, block_table, s_bt, seq, k_start,
                                  k_len, kv_head, offs_m, offset, sk_t, sk_h, sv_t, sv_h, ss_t, ss_h, scale_log2,
                                  D, BLOCK_N, BLOCK_D, CAUSAL, IEEE, PAGED, PAGE, KV_BITS, MASKED=True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                        # a query with no keys: acc = 0
    # Write the O tile once: BLOCK_M x D x e bytes.
    tl.store(O + (q_start + offs_m)[:, None] * so_t + head * so_h + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=(offs_m[:, None] < q_len) & d_ok[None, :])


@triton.jit(do_not_specialize=["n_splits", "s_bt"])
def _decode_split_kernel(
    Q, K, V, seqlens, O_part, LSE_part, scale_log2, n_splits, block_table, s_bt,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_h, so_s, sl_b, sl_h,
    K_s, V_s, ss_b, ss_t, ss_h,                           # scales of a quantized cache (KV_BITS 8 or 4)
    D: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, KV_BITS: tl.constexpr,
):
    # One program: one sequence, one KV head with all GROUP query heads it serves, one slice of keys.
    # Each sequence cuts its own keys into n_splits slices of whole tiles, so a short cache has short
    # slices (or none past its end) and the same launch serves any lengths, as a captured graph needs.
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seqlen = tl.load(seqlens + b)
    keys_per_split = tl.cdiv(tl.cdiv(seqlen, n_splits), BLOCK_N) * BLOCK_N
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, seqlen)
    offs_h = tl.arange(0, BLOCK_H)               # query heads of this group (padded to a tile)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # Read the group's queries: GROUP x D x e bytes.
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if PAGED:  # key j lives in page block_table[b, j // PAGE], at row j % PAGE
            page = tl.load(block_table + b * s_bt + cols // PAGE, mask=cols < hi, other=0)
            rows = page * PAGE + cols % PAGE
            k_off, v_off, s_off = rows * sk_t, rows * sv_t, rows * ss_t
        else:      # contiguous: sequence b's own cache, key j at row j
            k_off, v_off, s_off = b * sk_b + cols * sk_t, b * sv_b + cols * sv_t, b * ss_b + cols * ss_t
        # Each K/V byte of this slice is read once for all GROUP heads: 2 x BLOCK_N x D x e bytes.
        row_ok = cols < hi
        s_off = s_off + kv_head * ss_h
        k = _load_kv(K, K_s, k_off + kv_head * sk_h, s_off, row_ok, d_ok, offs_d, KV_BITS).to(q.dtype)
        v = _load_kv(V, V_s, v_off + kv_head * sv_h, s_off, row_ok, d_ok, offs_d, KV_BITS).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(cols[None, :] < hi, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    # Write this slice's normalized output and its log-sum-exp (log2 units): GROUP x (D + 1) x 4 bytes.
    l_safe = tl.where(l_i > 0, l_i, 1.0)                                     # an empty slice: acc = 0
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
    tl.store(O_part + b * so_b + heads[:, None] * so_h + split * so_s + offs_d[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])
    tl.store(LSE_part + b * sl_b + heads * sl_h + split, lse, mask=h_ok)


@triton.jit(do_not_specialize=["n_splits"])
def _decode_reduce_kernel(
    O_part, LSE_part, O, n_splits, so_b, so_h, so_s, sl_b, sl_h, sO_b, sO_h,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: one (sequence, head). Combine the slices' softmaxes: weights 2^(lse_i - max lse).
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    lse = tl.load(LSE_part + b * sl_b + h * sl_h + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)                                            # (BLOCK_S,)
    o = tl.load(O_part + b * so_b + h * so_h + offs_s[:, None] * so_s + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)          # (BLOCK_S, BLOCK_D)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + b * sO_b + h * sO_h + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _smoke_kernel(X, N: tl.constexpr):
    tl.store(X + tl.arange(0, N), tl.zeros([N], tl.float32) + 1.0)


INTERPRETED = type(_flash_fwd_kernel).__name__ == "InterpretedFunction"
NEED_INTERPRETER = ("the Triton kernels need a GPU, or the Triton interpreter on CPU: set TRITON_INTERPRET=1 "
                    "in the environment before anything imports triton (torch may import it while loading a "
                    "model), e.g. `TRITON_INTERPRET=1 python ...`")
_interpreter_ok: bool | None = None


def _interpreter_works() -> bool:
    """The interpreter must be on from the moment triton is imported; set later, it half works.
    One tiny launch tells."""
    global _interpreter_ok
    if _interpreter_ok is None:
        try:
            x = torch.zeros(16)
            _smoke_kernel[(1,)](x, N=16)
            _interpreter_ok = bool((x == 1).all())
        except Exception:
            _interpreter_ok = False
    return _interpreter_ok


def _check(*tensors) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    if dev.type == "cpu" and not (INTERPRETED and _interpreter_works()):
        raise RuntimeError(NEED_INTERPRETER)
    for t in tensors:
        if t.is_floating_point() and t.stride(-1) != 1:
            raise ValueError("the last (head) dimension must be contiguous")


def _unpack_kv(k, v):
    """k, v: float tensors or `QuantizedKV` -> (k, v, k scales, v scales, bits). For a float cache the
    scale pointers are k and v themselves, never read (bits 0)."""
    from ..kv.quantized import QuantizedKV

    if not isinstance(k, QuantizedKV):
        return k, v, k, v, 0
    return k.codes, v.codes, k.scale, v.scale, 8 if k.kv_dtype == "int8" else 4


def _blocks(D: int) -> int:
    if D > 256:
        raise ValueError(f"head dim {D} is not supported (at most 256)")
    return max(16, triton.next_power_of_2(D))


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k=None,
                      causal: bool = True, softmax_scale: float | None = None, block_table=None,
                      block_m: int = 64, block_n: int = 64, out: torch.Tensor | None = None,
                      num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Packed variable-length attention. q: (total_q, H, D); k, v: (total_k, H_kv, D);
    cu_seqlens_*: (batch + 1,) int32 cumulative lengths -> out (total_q, H, D).

    With a `block_table` (batch, max_blocks) int32, k and v are paged caches
    (num_blocks, block_size, H_kv, D) and cu_seqlens_k still gives each sequence's key count:
    the new queries attend to a prefix that lives in pages (prefix caching, chunked prefill).
    k and v may be `QuantizedKV` (int8 or 4-bit codes and their scales): tiles are dequantized as loaded."""
    k, v, k_s, v_s, bits = _unpack_kv(k, v)
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    total_q, H, D = q.shape
    H_kv = k.shape[-2]
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({H_kv})")
    k, v, page, table = _paged_view(k, v, block_table)
    k_s, v_s, _, _ = _paged_view(k_s, v_s, block_table) if bits else (k, v, 0, 0)
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q) if out is None else out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, H)
    _flash_fwd_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2E, table, table.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_s, v_s, k_s.stride(0), k_s.stride(1),
        D=D, GROUP=H // H_kv, CAUSAL=causal, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_blocks(D), PAGED=block_table is not None, PAGE=page, KV_BITS=bits,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _paged_view(k, v, block_table):
    """Paged caches (num_blocks, block_size, H_kv, D) as (num_blocks * block_size, H_kv, D) rows,
    with the page size; without a block table, a dummy table the kernel never reads."""
    if block_table is None:
        return k, v, 1, torch.zeros(1, 1, dtype=torch.int32, device=k.device)
    if k.dim() != 4 or block_table.dtype != torch.int32:
        raise ValueError("with block_table, k/v must be (num_blocks, block_size, H_kv, D) and block_table int32")
    page = k.shape[1]
    return k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), page, block_table


@functools.cache
def _sm_count(index: int | None) -> int:
    """The GPU's multiprocessors, asked once: asking costs more host time than a short decode kernel runs."""
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_seqlen: int, block_n: int, device,
                       sm_count: int | None = None) -> int:
    """Enough slices that batch x kv_heads x splits fills the GPU (about 2 programs per SM), but no slice
    shorter than a tile of the longest sequence: max_seqlen is the longest cache's *length*, not its capacity
    (a 40-token cache in 8,192 slots is one tile, one slice). On CPU (the interpreter) fewer, larger slices
    are faster. sm_count: the GPU's streaming multiprocessors (default: asked of the device)."""
    if device.type == "cuda":
        target = 2 * (sm_count or _sm_count(device.index))
    else:
        target = 4
    want = triton.cdiv(target, batch * kv_heads)
    return max(1, min(want, triton.cdiv(max_seqlen, block_n)))


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale: float | None = None,
                     num_splits: int | None = None, block_n: int = 64, out: torch.Tensor | None = None,
                     max_seqlen_k: int | None = None) -> torch.Tensor:
    """One query per sequence against its cache -> out (B, H, D). q: (B, H, D);
    cache_seqlens: (B,) int32, the number of valid keys per sequence. max_seqlen_k: the largest of them, if
    the caller knows it (otherwise it is read from cache_seqlens, which waits for the GPU); it sets the
    number of key slices. num_splits fixes that number instead (a captured graph needs it fixed).

    Contiguous: k_cache, v_cache (B, max_len, H_kv, D). Paged (flash-attn's flash_attn_with_kvcache
    convention): k_cache, v_cache (num_blocks, block_size, H_kv, D) and block_table (B, max_blocks)
    int32 mapping each sequence's logical blocks to physical ones. Either cache may be `QuantizedKV`."""
    k_cache, v_cache, k_s, v_s, bits = _unpack_kv(k_cache, v_cache)
    _check(q, k_cache, v_cache, cache_seqlens)
    B, H, D = q.shape
    H_kv = k_cache.shape[2]
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({H_kv})")
    k_rows, v_rows, page, table = _paged_view(k_cache, v_cache, block_table)
    ks_rows, vs_rows, _, _ = _paged_view(k_s, v_s, block_table) if bits else (k_rows, v_rows, 0, 0)
    if num_splits is None:
        longest = int(cache_seqlens.max()) if max_seqlen_k is None else max_seqlen_k
        num_splits = default_num_splits(B, H_kv, longest, block_n, q.device)
    splits = num_splits
    o_part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    group = H // H_kv
    if block_table is None:  # (B, max_len, H_kv, D): strides of batch, token, head
        sk = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        sv = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        ss = (ks_rows.stride(0), ks_rows.stride(1), ks_rows.stride(2))
    else:                    # rows of all pages: (num_blocks * block_size, H_kv, D)
        sk = (0, k_rows.stride(0), k_rows.stride(1))
        sv = (0, v_rows.stride(0), v_rows.stride(1))
        ss = (0, ks_rows.stride(0), ks_rows.stride(1))
    _decode_split_kernel[(B, H_kv, splits)](
        q, k_rows, v_rows, cache_seqlens, o_part, lse_part, scale * LOG2E, splits, table, table.stride(0),
        q.stride(0), q.stride(1), *sk, *sv,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        ks_rows, vs_rows, *ss,
        D=D, GROUP=group, IEEE=q.dtype == torch.float32,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=_blocks(D),
        PAGED=block_table is not None, PAGE=page, KV_BITS=bits,
    )
    out = torch.empty_like(q) if out is None else out
    _decode_reduce_kernel[(B, H)](
        o_part, lse_part, out, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=_blocks(D),
    )
    return out
