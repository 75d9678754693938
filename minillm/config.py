"""ModelConfig: the numbers that fix a Llama-family model's shape."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    n_layers: int = 30
    d_model: int = 576          # hidden size
    n_heads: int = 9            # query heads
    n_kv_heads: int = 3         # key/value heads (GQA: n_heads // n_kv_heads queries share one)
    head_dim: int = 64
    ffn_dim: int = 1536         # SwiGLU inner size
    vocab_size: int = 49152
    rope_base: float = 100000.0
    rms_eps: float = 1e-5
    max_seq_len: int = 8192     # context length the model was trained for
    tie_embeddings: bool = True
    name: str = "SmolLM2-135M-Instruct"
    # RoPE's frequencies rescaled for a longer context, as transformers defines it: None, or
    # (("rope_type", "llama3" | "linear"), ("factor", ...), ...), or a GGUF file's per-frequency divisors
    # (("rope_type", "freq_factors"), ("factors", (...))) (`model.rope_inv_freq` reads it)
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    qkv_bias: bool = False      # Qwen2/2.5: the Q, K and V projections add a bias
    qk_norm: bool = False       # Qwen3: q and k are RMS-normalized per head before RoPE

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def group_size(self) -> int:
        """How many query heads share one KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_gguf_fields(cls, meta: dict, tie_embeddings: bool) -> "ModelConfig":
        """Build a config from GGUF metadata (`llama.*` keys, already decoded to Python values).

        GGUF has no flag for tied embeddings: a file without an `output.weight` tensor is tied."""
        arch = meta["general.architecture"]
        a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
        d_model = int(a("embedding_length"))
        n_heads = int(a("attention.head_count"))
        vocab = a("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        return cls(
            n_layers=int(a("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            head_dim=int(a("attention.key_length", d_model // n_heads)),
            ffn_dim=int(a("feed_forward_length")),
            vocab_size=int(vocab),
            rope_base=float(a("rope.freq_base", 10000.0)),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
            max_seq_len=int(a("context_length", 2048)),
            tie_embeddings=tie_embeddings,
            name=str(meta.get("general.name", "gguf model")),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build a config from a Hugging Face `config.json` of a Llama-family model."""
        n_heads = cfg["num_attention_heads"]
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}   # transformers 4 | 5
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"RoPE scaling {kind!r} is not supported; minillm computes {', '.join(ROPE_TYPES)} "
                             f"as transformers defines them")
        keys = ROPE_TYPES[kind]
        if missing := [k for k in keys if k not in rope]:
            raise ValueError(f"RoPE scaling {kind!r} needs {missing} in config.json")
        # dynamic NTK changes nothing within max_position_embeddings (it raises the base only past it, where
        # transformers' frequencies would depend on the longest length seen so far), and the context stops there
        scaling = None if kind in ("default", "dynamic") else (("rope_type", kind), *((k, float(rope[k])) for k in keys))
        return cls(
            n_layers=cfg["num_hidden_layers"],
            d_model=cfg["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            ffn_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rope_base=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # a sliding window (Mistral 7B v0.1): within it, attention is the full causal one
            max_seq_len=min(cfg.get("max_position_embeddings", 2048),
                            cfg.get("use_sliding_window", True) and cfg.get("sliding_window") or 1 << 62),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=cfg.get("_name_or_path") or cfg.get("model_type", "hf model"),
            rope_scaling=scaling,
            qkv_bias=cfg.get("model_type") == "qwen2",
            qk_norm=cfg.get("model_type") == "qwen3",
        )


# the RoPE scalings minillm computes, and the numbers each reads from config.json
ROPE_TYPES = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
