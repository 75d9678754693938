"""A Llama-family transformer in plain PyTorch (SmolLM2, Llama 2/3, Mistral shapes).

    ids -> tok_emb -> n_layers x [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> lm_head -> logits

The attention function is passed in (`attn_fn`), so later stages plug in their
own without copying the model, and so is the KV storage (`cache`). With
`cache=None` the model sees the whole sequence every call: stage 1, the naive engine.

Two projections are fused, as most engines do: Q, K and V come from one matrix
(`wqkv`), the SwiGLU gate and up from another (`w_gate_up`). The math is the same
as three (two) separate matrices; a decode step makes 4 matrix-vector products
per layer instead of 7, and each one costs a fixed overhead on top of its bytes.
"""
from __future__ import annotations

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


def rope_tables(head_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (..., head_dim) for positions of shape (...), e.g. (T,) or (B, T).

    Frequency i (of head_dim/2) turns by positions * base^(-2i/head_dim); each
    frequency is used twice, for the pair (x_i, x_{i + head_dim/2}).
    """
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = positions.float()[..., None] * inv_freq.to(positions.device)                   # (..., hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                            # (..., hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, heads, T, hd); cos, sin: (T, hd) or (B, 1, T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)                  # (B, heads, T, hd/2) each
    rotated = torch.cat([-x2, x1], dim=-1)       # (B, heads, T, hd)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, attn_fn, mask=None, cache=None, layer: int = 0):
        B, T, _ = x.shape
        H, n_kv, hd = self.n_heads, self.n_kv, self.hd
        qkv = self.wqkv(x).view(B, T, H + 2 * n_kv, hd).transpose(1, 2)   # (B, H + 2 n_kv, T, hd)
        qk = apply_rope(qkv[:, :H + n_kv], cos, sin)                        # rotate q and k together
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + n_kv:]                   # (B, H | n_kv | n_kv, T, hd)
        if cache is not None:  # stage 2+: store this step's K/V, attend over everything cached
            k, v = cache.update(layer, k, v)                                # (B, n_kv, S, hd)
        out = attn_fn(q, k, v, mask)                                        # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * hd))


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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_fn, mask=None, cache=None, layer=0):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_fn, mask, cache, layer)
        return x + self.mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    kv_cache_dtype: str | None = None   # how caches built for this model store K/V (`kv/quantized.py`)

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

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                mask: torch.Tensor | None = None, attn_fn=None,
                logit_indices: torch.Tensor | None = None, n_layers: int | None = None) -> torch.Tensor:
        """ids: (B, T) -> logits (B, T, vocab).

        positions: (T,) or (B, T) absolute positions, for RoPE (default 0 .. T-1).
        cache: a KV cache (stage 2+) that stores this call's keys/values and returns all of them.
        mask: (B, 1, T, S) bool, True where a query may attend a key (default: causal).
        logit_indices: (M,) positions along T whose logits are wanted -> logits (B, M, vocab).
            A prefill chunk needs only its last token's; the output head is the biggest
            matrix of the model (49,152 x 576 here), so skipping the other rows matters.
        n_layers: run only the first n_layers blocks, then the final norm and head: the same model
            made cheaper, a draft for speculative decoding (self-speculation by layer skipping).
        """
        attn_fn = attn_fn or self.attn_fn
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_base)  # (T, hd) or (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]                                 # (B, 1, T, hd)
        x = self.tok_emb(ids)                                                      # (B, T, d)
        for i, block in enumerate(self.layers):
            if n_layers is not None and i >= n_layers:
                break
            x = block(x, cos, sin, attn_fn, mask, cache, i)
        if logit_indices is not None:
            x = x[:, logit_indices]                                                # (B, M, d)
        x = self.norm(x)
        if "lm_head" in self._modules:   # untied, or a quantized head (`quant/`)
            return self.lm_head(x).float()                                        # (B, T, vocab)
        return F.linear(x, self.tok_emb.weight).float()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def fuse_projections(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Separate wq/wk/wv and w_gate/w_up (as files store them) -> fused wqkv and w_gate_up."""
    state = dict(state)
    for i in range(n_layers):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        state[a + "wqkv.weight"] = torch.cat([state.pop(a + f"{w}.weight") for w in ("wq", "wk", "wv")])
        state[m + "w_gate_up.weight"] = torch.cat([state.pop(m + f"{w}.weight") for w in ("w_gate", "w_up")])
    return state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], attn_fn=naive_attention) -> Transformer:
    """A Transformer with `state` (file names: wq, wk, wv, w_gate, w_up) loaded; strict:
    every weight present, none left over."""
    with torch.device("meta"):
        model = Transformer(cfg, attn_fn)
    model.load_state_dict(fuse_projections(state, cfg.n_layers), strict=True, assign=True)
    return model.eval().requires_grad_(False)
