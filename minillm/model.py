"""A Llama-family transformer in plain PyTorch (SmolLM2, Llama 2/3, Mistral shapes).

    ids -> tok_emb -> n_layers x [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> lm_head -> logits

The attention function is passed in (`attn_fn`), so later stages plug in their
own (a KV cache, a Triton kernel) without copying the model. With `cache=None`
the model sees the whole sequence every call: that is stage 1, the naive engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import naive_attention
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(head_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, head_dim) for the given positions (T,).

    Frequency i (of head_dim/2) turns by positions * base^(-2i/head_dim); each
    frequency is used twice, for the pair (x_i, x_{i + head_dim/2}).
    """
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = positions.float()[:, None] * inv_freq[None, :]                             # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                        # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, heads, T, hd); cos, sin: (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)                  # (B, heads, T, hd/2) each
    rotated = torch.cat([-x2, x1], dim=-1)       # (B, heads, T, hd)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, attn_fn, cache=None, layer: int = 0):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)     # (B, n_kv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)     # (B, n_kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # stage 2+: store this step's K/V, attend over everything cached
            k, v = cache.update(layer, k, v)                                # (B, n_kv, S, hd)
        out = attn_fn(q, k, v)                                              # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_fn, cache=None, layer=0):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_fn, cache, layer)
        return x + self.mlp(self.ffn_norm(x))


class Transformer(nn.Module):
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
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def forward(self, ids: torch.Tensor, start_pos: int = 0, cache=None, attn_fn=None) -> torch.Tensor:
        """ids: (B, T) token ids at positions start_pos .. start_pos+T-1 -> logits (B, T, vocab)."""
        attn_fn = attn_fn or self.attn_fn
        B, T = ids.shape
        positions = torch.arange(start_pos, start_pos + T, device=ids.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_base)      # (T, hd)
        cos, sin = cos.to(ids.device), sin.to(ids.device)
        x = self.tok_emb(ids)                                                          # (B, T, d)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, attn_fn, cache, i)
        x = self.norm(x)
        w_out = self.tok_emb.weight if self.cfg.tie_embeddings else self.lm_head.weight
        return F.linear(x, w_out).float()                                             # (B, T, vocab)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], attn_fn=naive_attention) -> Transformer:
    """A Transformer with `state` loaded (strict: every weight present, none left over)."""
    with torch.device("meta"):
        model = Transformer(cfg, attn_fn)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
