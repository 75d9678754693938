"""SmoothQuant scales for int8 activations (Xiao et al., 2022): move outliers from activations to weights.

A few input channels of some layers carry activations tens of times larger than the rest, in every
token. Quantizing a token to int8 with one scale then spends its 255 levels on those channels and
rounds the others to almost nothing. Since  x @ W^T = (x / s) @ (W * s)^T  for any per-channel s,
dividing channel j of the activations by

    s_j = max|x_j| ** alpha / max|W_:,j| ** (1 - alpha)

(and multiplying column j of the weight by it) evens out the activations; the weight, quantized per
output row, absorbs the larger column with less harm. alpha = 0.5 splits the difficulty evenly.
max|x_j| comes from running the float model on calibration text (`CALIBRATION` below, a few lines of
prose, chat and code), never on the held-out text the quality is measured on.
"""
from __future__ import annotations

import torch

from .apply import LINEARS

CALIBRATION = [
    "What is the capital of France? The capital of France is Paris, a city on the river Seine.",
    "Explain in two sentences why the sky is blue. Sunlight is scattered by the molecules of the air, "
    "and blue light, with its shorter wavelength, is scattered far more than red.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once been late.",
    "List three uses of a paperclip: 1. holding papers together 2. resetting a router 3. a bookmark.",
    "The results table shows 12.5% growth in 2023, up from 7.1% in 2022; costs fell by $3,400.",
]


@torch.inference_mode()
def activation_absmax(model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """{"layers.{i}.{part}.{name}": (in,) the largest |input| of each channel over all prompts' tokens}."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.layers):
        for part, name in LINEARS:
            key = f"layers.{i}.{part}.{name}"

            def hook(_module, args, key=key):
                m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float().cpu()   # (in,)
                stats[key] = torch.maximum(stats[key], m) if key in stats else m

            hooks.append(getattr(getattr(block, part), name).register_forward_pre_hook(hook))
    try:
        for ids in prompts:
            model(torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return stats


def smooth_scales(model, prompts: list[list[int]], alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """Per-layer SmoothQuant factors s (in,) for `quantize_model(model, "w8a8", smooth=...)`.
    prompts: token ids of calibration text, e.g. [tokenizer.encode(t) for t in CALIBRATION]."""
    act = activation_absmax(model, prompts)
    scales = {}
    for i, block in enumerate(model.layers):
        for part, name in LINEARS:
            key = f"layers.{i}.{part}.{name}"
            w_max = getattr(getattr(block, part), name).weight.detach().abs().amax(0).float().cpu()   # (in,)
            s = act[key].clamp_min(1e-5) ** alpha / w_max.clamp_min(1e-5) ** (1 - alpha)
            scales[key] = s.clamp(1e-2, 1e2).to(model.device)
    return scales
