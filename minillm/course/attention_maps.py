"""What every head attends to: the softmax weights of each layer, recorded while the model runs (notebook 01).

The model's attention returns only its output; this runs one forward pass with an attention function that
also keeps the weights, so a notebook can draw them. (Its body is notebook 01's Exercise 2, for every head
at once: read it after the exercise.)"""
from __future__ import annotations

import math

import torch

from ..attention import naive_attention
from ..model import FullAttention


def attention_maps(model, ids: list[int]) -> list[torch.Tensor]:
    """One forward pass over `ids`; per layer, the weights (n_heads, T, T): row t is how position t spreads
    its attention over positions 0..t."""
    recorded = []

    def recording(q, k, v, mask=None):
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)                    # (B, H, S, hd)
        scores = q @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])                    # (B, H, T, S)
        T, S = scores.shape[-2:]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        recorded.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[0].cpu())
        return naive_attention(q, k, v, mask)

    with torch.inference_mode():
        model(torch.tensor([ids], device=model.device), attn=FullAttention(recording))
    return recorded
