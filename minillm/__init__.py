"""minillm: a small LLM inference engine, built one idea at a time.

    model = minillm.load_model()          # SmolLM2-135M-Instruct from its GGUF, float32
    tok = minillm.load_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
"""
from __future__ import annotations

from .config import ModelConfig
from .loading import DTYPES, load_model, load_tokenizer, parse_dtype
from .model import Transformer
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import ModelNotFoundError, find_model

__all__ = ["LLM", "ModelConfig", "ModelNotFoundError", "SamplingParams", "Tokenizer", "Transformer",
           "find_model", "load_model", "load_tokenizer"]


def __getattr__(name: str):
    """`minillm.LLM`, the serving engine, is imported when first asked for: `import minillm` loads the
    model code only."""
    if name == "LLM":
        from .engine import LLM

        return LLM
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
