"""A Llama-family transformer in plain PyTorch (SmolLM2, Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 shapes).

This is the reference every stage runs and every backend is checked against: PyTorch's operators only.
Faster kernels for a device are swapped in from outside, on a copy (`backends/`).

    ids -> tok_emb -> n_layers x [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> lm_head -> logits

Attention is the one part that changes from stage to stage, so the model does not do it
itself: each call gets an attention context `attn` with one method,

    attn.attend(layer, q, k, v) -> out    q (B, H, T, hd); k, v (B, n_kv, T, hd): this call's new keys
                                          and values, which the context may store before attending

`FullAttention` (stage 1) keeps nothing: the call's queries attend its own keys, causally.
`kv.CachedAttention` (stages 2 and 3) stores them in a contiguous KV cache and attends over all
cached keys; `attention.PagedAttention` (stages 4 and 5) writes them to their slots of a paged
pool and attends through block tables.

Two projections are fused, as most engines do: Q, K and V come from one matrix
(`wqkv`), the SwiGLU gate and up from another (`w_gate_up`). The math is the same
as three (two) separate matrices; a decode step makes 4 matrix-vector products
per layer instead of 7, and each one costs a fixed overhead on top of its bytes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import naive_attention
from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, base: float, scaling=None, device=None) -> torch.Tensor:
    """(head_dim/2,) how fast each pair turns per position: base^(-2i/head_dim), rescaled for a longer
    context where the model says so (ModelConfig.rope_scaling), as transformers computes it:
    linear divides every frequency by `factor`; llama3 (Llama 3.1/3.2) divides only the slow ones
    (wavelengths beyond original_max_position_embeddings / low_freq_factor), keeps the fast ones
    (shorter than ... / high_freq_factor), and blends in between; a GGUF file stores that as one divisor
    per frequency (freq_factors)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is None:
        return inv_freq
    s = dict(scaling)
    if s["rope_type"] == "freq_factors":      # llama.cpp's rope_freqs: the same llama3 scaling, as one divisor each
        return inv_freq / torch.tensor(s["factors"], dtype=torch.float32, device=device)
    factor = s["factor"]
    if s["rope_type"] == "linear":
        return inv_freq / factor
    low, high, old = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rope_tables(head_dim: int, positions: torch.Tensor, base: float, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (..., head_dim) for positions of shape (...), e.g. (T,) or (B, T).

    Frequency i (of head_dim/2) turns by positions * base^(-2i/head_dim) (rope_inv_freq); each
    frequency is used twice, for the pair (x_i, x_{i + head_dim/2}). The first half of
    `sin` is negated: rotate-half's minus sign, folded into the table (see apply_rope).
    """
    # built where positions live: a CUDA graph's captured step may not copy from the CPU
    inv_freq = rope_inv_freq(head_dim, base, scaling, positions.device)                     # (hd/2,)
    angles = positions.float()[..., None] * inv_freq                                        # (..., hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                            # (..., hd)
    sign = torch.ones(head_dim, device=positions.device)
    sign[:head_dim // 2] = -1
    return angles.cos(), angles.sin() * sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, heads, T, hd); cos, sin from rope_tables: (T, hd) or (B, 1, T, hd).

    Pair (x_i, x_{i+hd/2}) turns by angle a: (x_i cos a - x_{i+hd/2} sin a, x_{i+hd/2} cos a + x_i sin a).
    roll swaps the halves, [x2, x1], and sin's first half carries the minus sign: four operators
    per call and no concatenation, with the same values bit for bit as cat([-x2, x1]) * sin.
    """
    out = x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin   # (B, heads, T, hd)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class Attention(nn.Module):
    """Q, K, V from one product, RoPE on q and k. Two family flags (ModelConfig): `qkv_bias` (Qwen2) adds a
    bias to that product; `qk_norm` (Qwen3) RMS-normalizes each head of q and of k before RoPE."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps), RMSNorm(cfg.head_dim, cfg.rms_eps)

    def qkv(self, x, cos, sin):
        """x (B, T, d) -> q (B, H, T, hd), k and v (B, n_kv, T, hd): one product, RoPE on q and k."""
        B, T, _ = x.shape
        H, n_kv, hd = self.n_heads, self.n_kv, self.hd
        qkv = self.wqkv(x).view(B, T, H + 2 * n_kv, hd).transpose(1, 2)   # (B, H + 2 n_kv, T, hd)
        qk, v = qkv.split([H + n_kv, n_kv], dim=1)
        if "q_norm" in self._modules:                                      # Qwen3: per head, over hd
            q, k = qk.split([H, n_kv], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)        # (B, H + n_kv, T, hd)
        q, k = apply_rope(qk, cos, sin).split([H, n_kv], dim=1)            # rotate q and k together
        return q, k, v                                                      # (B, H | n_kv | n_kv, T, hd)

    def output(self, out):
        """out (B, H, T, hd), the heads' attention -> (B, T, d)."""
        return self.wo(out.transpose(1, 2).flatten(2))                     # (B, T, H hd) -> (B, T, d)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matrix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, T, ffn) each
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)). Everything but `attn.attend` sits in two methods,
    the same for every layer and every attention context: `minillm/compile.py` compiles just those."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, layer=0):
        q, k, v = self.before_attention(x, cos, sin)
        return self.after_attention(x, attn.attend(layer, q, k, v))

    def before_attention(self, x, cos, sin):
        return self.attn.qkv(self.attn_norm(x), cos, sin)

    def after_attention(self, x, out):
        x = x + self.attn.output(out)
        return x + self.mlp(self.ffn_norm(x))


class FullAttention:
    """Stage 1's attention context: no cache. Queries attend this call's own keys (causal, or `mask`:
    (B, 1, T, T) bool, True where a query may attend a key)."""

    def __init__(self, attn_fn=naive_attention, mask: torch.Tensor | None = None):
        self.attn_fn, self.mask = attn_fn, mask

    def attend(self, layer: int, q, k, v):
        return self.attn_fn(q, k, v, self.mask)                            # (B, H, T, hd)


class Transformer(nn.Module):
    quant: str | None = None   # the weights' format when quantized (`quant/apply.py`)

    def __init__(self, cfg: ModelConfig, attn_fn=naive_attention):
        super().__init__()
        self.cfg = cfg
        self.attn_fn = attn_fn
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations, norms and the KV cache (quantized weights keep their own)."""
        return self.norm.weight.dtype

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, attn=None,
                logit_indices: torch.Tensor | None = None, n_layers: int | None = None) -> torch.Tensor:
        """ids: (B, T) -> logits (B, T, vocab).

        positions: (T,) or (B, T) absolute positions, for RoPE (default 0 .. T-1).
        attn: the attention context (`attend(layer, q, k, v)`); default FullAttention(self.attn_fn):
            no cache, causal.
        logit_indices: (M,) positions along T whose logits are wanted -> logits (B, M, vocab).
            A prefill chunk needs only its last token's; the output head is the biggest
            matrix of the model (49,152 x 576 here), so skipping the other rows matters.
        n_layers: run only the first n_layers blocks, then the final norm and head: the same model
            made cheaper, a draft for speculative decoding (self-speculation by layer skipping).
        """
        attn = attn or FullAttention(self.attn_fn)
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_base,
                               self.cfg.rope_scaling)                              # (T, hd) or (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]                                 # (B, 1, T, hd)
        x = self.tok_emb(ids)                                                      # (B, T, d)
        for i, block in enumerate(self.layers):
            if n_layers is not None and i >= n_layers:
                break
            x = block(x, cos, sin, attn, i)
        if logit_indices is not None:
            x = x[:, logit_indices]                                                # (B, M, d)
        x = self.norm(x)
        if "lm_head" in self._modules:   # untied, or a quantized head (`quant/`)
            return self.lm_head(x).float()                                        # (B, T, vocab)
        return F.linear(x, self.tok_emb.weight).float()                           # the tied head

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def fuse_projections(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Separate wq/wk/wv and w_gate/w_up (as files store them) -> fused wqkv and w_gate_up."""
    state = dict(state)
    for i in range(n_layers):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        state[a + "wqkv.weight"] = torch.cat([state.pop(a + f"{w}.weight") for w in ("wq", "wk", "wv")])
        if a + "wq.bias" in state:                                          # Qwen2
            state[a + "wqkv.bias"] = torch.cat([state.pop(a + f"{w}.bias") for w in ("wq", "wk", "wv")])
        state[m + "w_gate_up.weight"] = torch.cat([state.pop(m + f"{w}.weight") for w in ("w_gate", "w_up")])
    return state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], attn_fn=naive_attention) -> Transformer:
    """A Transformer with `state` (file names: wq, wk, wv, w_gate, w_up) loaded; strict:
    every weight present, none left over."""
    with torch.device("meta"):
        model = Transformer(cfg, attn_fn)
    model.load_state_dict(fuse_projections(state, cfg.n_layers), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def weight_bytes(model) -> int:
    """Bytes of the model's weights as it holds them: every parameter and saved buffer (quantized codes
    and scales included), each tensor counted once. A copy that a CPU kernel keeps in its own layout
    (`Q4Linear`'s repacked codes: the same weights again) is not saved, and not counted."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
