"""Loading a model and its tokenizer: `minillm.load_model`, `minillm.load_tokenizer` (re-exported by the package)."""
from __future__ import annotations

from pathlib import Path

import torch

from .model import Transformer, build_model
from .tokenizer import Tokenizer
from .weights import find_model, load_state


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device | None = None, attn_fn=None, quant: str | None = None,
               backend: str = "torch") -> Transformer:
    """Load a Llama-family model (GGUF file or Hugging Face folder; default: the course model).

    device: where it runs; by default the GPU when torch sees one, else the CPU (`minillm.device`).
    dtype: of activations, norms and the KV cache (and of the weights, unquantized): float32, float16
        or bfloat16 (a name or a torch.dtype).
    quant: None, or quantized weights (`minillm.quant`): "int8", "w8a8", "q4", or "q4_file" (the GGUF
        file's own 4-bit blocks).
    backend: "torch" (the plain model), "native" or "auto" (`minillm.backends`: faster kernels for this
        device, swapped into a copy of the model's modules, chosen by measurement now).
    How a KV cache stores keys and values (int8 or int4, `minillm.kv.quantized`) is the cache's own
    setting: `kv_cache_dtype=` of generate, the runners and the engine.
    """
    from .device import pick_device
    from .quant import check_format, quantize_model
    from .quant.smoothquant import CALIBRATION, smooth_scales

    dtype, device = parse_dtype(dtype), pick_device(device)
    check_format(quant)
    from .memory import release_memory

    cfg, state, _ = load_state(path, dtype)
    kwargs = {"attn_fn": attn_fn} if attn_fn is not None else {}
    model = build_model(cfg, state, **kwargs)
    del state
    model = model.to(device)
    if quant == "w8a8":
        tok = load_tokenizer(path)
        model = quantize_model(model, quant, smooth=smooth_scales(model, [tok.encode(t) for t in CALIBRATION]))
    elif quant:
        model = quantize_model(model, quant, path)
    release_memory()          # the dequantized copies made while loading go back to the OS
    if backend != "torch":
        from .backends import apply_backend

        model = apply_backend(model, backend)
    return model


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """"float32" | "float16" | "bfloat16" (or the torch.dtype) -> the torch.dtype; anything else: ValueError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The model's tokenizer: from its GGUF file, or a Hugging Face folder's tokenizer.json (default: the course
    model's). Byte-level BPE with a pre-tokenizer minillm knows; anything else is refused in one line."""
    path = find_model(path)
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
