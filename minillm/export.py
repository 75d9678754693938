"""The model as a Hugging Face folder, for the tools people compare minillm with.

`export(out_dir)` writes what transformers, vLLM, guidellm and lm-eval load without a hub:

    config.json                a LlamaForCausalLM config from the model's shape
    model.safetensors          the weights minillm runs (a GGUF file's blocks dequantized, Q/K rows in
                               Hugging Face's rotate-half order), under Hugging Face's names, in `dtype`
    generation_config.json     the ids that start and end a text
    tokenizer.json             the same vocabulary and merges with SmolLM2's original pre-tokenizer
                               (each digit alone, then GPT-2 byte-level; `tokenizer.py` says why)
    tokenizer_config.json      the special tokens and the chat template the file carries
    special_tokens_map.json

So every peer reads exactly the weights and the token ids minillm uses: a comparison between engines
then differs in the engine only. tests/test_export.py loads the folder with transformers and checks
its logits, greedy tokens and token ids against minillm's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .loading import parse_dtype
from .tokenizer import Tokenizer
from .weights import find_model, gguf_reader, load_state

# minillm's state-dict names (as files store them: separate q/k/v and gate/up) -> Hugging Face's
_TOP = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj"}


def hf_name(name: str) -> str:
    """'layers.3.attn.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    base, suffix = name.rsplit(".", 1)
    if base.startswith("layers."):
        _, i, part = base.split(".", 2)
        return f"model.layers.{i}.{_LAYER[part]}.{suffix}"
    return f"{_TOP[base]}.{suffix}"


def hf_config(cfg, tok: Tokenizer, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_base,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
    }


def check_tokenizer(gguf_path: Path) -> None:
    """ValueError unless the file's tokenizer is one tokenizer_json writes (SmolLM2's)."""
    reader = gguf_reader(gguf_path)
    f = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
    if f("tokenizer.ggml.model") != "gpt2" or f("tokenizer.ggml.pre") not in ("smollm", None):
        raise ValueError(f"{gguf_path}: only byte-level BPE with SmolLM2's pre-tokenizer is exported")


def tokenizer_json(gguf_path: Path) -> dict:
    """tokenizer.json (Hugging Face tokenizers' format) for the vocabulary and merges in a GGUF file."""
    check_tokenizer(gguf_path)
    reader = gguf_reader(gguf_path)
    f = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
    tokens, types = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                  byte_level]},
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in f("tokenizer.ggml.merges")]},
    }


def tokenizer_config(gguf_path: Path, tok: Tokenizer, max_len: int) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json): the special tokens, and the file's chat template."""
    reader = gguf_reader(gguf_path)
    template = reader.fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in reader.fields \
        else None
    name = lambda i: None if i is None else tok.tokens[i]    # noqa: E731
    special = {"bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id), "unk_token": name(tok.unk_id),
               "pad_token": name(tok.eos_id)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast",   # tokenizer.json as written "model_max_length": max_len, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "additional_special_tokens": sorted(
                  set(tok.special_tokens) - set(special.values()), key=tok.special_tokens.get),
              **special, **({"chat_template": template} if template else {})}
    return config, special


def export(out_dir: str | Path, model: str | Path | None = None, dtype: torch.dtype | str = "float32") -> Path:
    """Write the model (a .gguf file; default: the course model) as a Hugging Face folder; returns it."""
    from safetensors.torch import save_file

    dtype, src = parse_dtype(dtype), find_model(model)
    if src.is_dir():
        raise ValueError(f"{src} is a Hugging Face folder already: load it as it is")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: export into a new or empty folder")
    check_tokenizer(src)                # its tokenizer is one export writes (checked before any file is written)
    cfg, state, _ = load_state(src, torch.float32)
    if cfg.rope_scaling or cfg.qkv_bias or cfg.qk_norm:
        raise ValueError(f"{src}: export writes Llama models without RoPE scaling; load this model's own folder")
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(src)
    weights = {hf_name(k): v.to(dtype).contiguous() for k, v in state.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write(out, {"config.json": hf_config(cfg, tok, dtype),
                 "generation_config.json": {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.stop_ids),
                                            "pad_token_id": tok.eos_id}})
    export_tokenizer(out, src)
    return out


def export_tokenizer(out_dir: str | Path, model: str | Path | None = None) -> Path:
    """The tokenizer files alone (what a load generator such as guidellm counts tokens with); returns the folder."""
    src, out = find_model(model), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(src)
    reader = gguf_reader(src)
    max_len = int(reader.fields["llama.context_length"].contents()) if "llama.context_length" in reader.fields \
        else 2048
    tok_config, special = tokenizer_config(src, tok, max_len)
    _write(out, {"tokenizer.json": tokenizer_json(src), "tokenizer_config.json": tok_config,
                 "special_tokens_map.json": special})
    return out


def _write(out: Path, files: dict) -> None:
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
