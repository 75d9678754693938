"""Pre-tokenization: how each model family cuts text into words before BPE merges inside them.

Two families with the same merge algorithm still tokenize differently if they cut words differently:
Llama 3 keeps up to three digits together and glues one punctuation mark to the letters after it; Qwen2
splits every digit and normalizes text to Unicode NFC first; SmolLM2 splits every digit and otherwise
cuts as GPT-2 does. A pattern is a regex whose matches are the words (tiktoken runs it).

The pattern is read from the model, never guessed: a GGUF file names it (`tokenizer.ggml.pre`, as
llama.cpp names them), a Hugging Face tokenizer.json describes it (its `pre_tokenizer` and `normalizer`).
"""
from __future__ import annotations

from dataclasses import dataclass

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's pattern with `\p{N}` alone (one digit per word) and whitespace stopping before digits: the
# one regex for SmolLM2's Digits(individual_digits) followed by GPT-2's byte-level split.
SMOLLM = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class PreTokenizer:
    name: str
    pattern: str        # the regex whose matches are the words
    nfc: bool = False   # normalize the text to Unicode NFC first


# llama.cpp's names (`tokenizer.ggml.pre`) -> what the Hugging Face tokenizer of that family does
BY_GGUF_NAME = {
    "gpt-2": PreTokenizer("gpt-2", GPT2),
    "smollm": PreTokenizer("smollm", SMOLLM),
    "llama-bpe": PreTokenizer("llama-bpe", LLAMA3),
    "qwen2": PreTokenizer("qwen2", QWEN2, nfc=True),
}


def from_gguf(name: str | None, where: str = "the file") -> PreTokenizer:
    if name not in BY_GGUF_NAME:
        raise ValueError(f"{where}: pre-tokenizer {name!r} is not supported; minillm splits text as "
                         f"{', '.join(BY_GGUF_NAME)} do")
    return BY_GGUF_NAME[name]


def from_tokenizer_json(spec: dict, where: str = "tokenizer.json") -> PreTokenizer:
    """The pre-tokenizer that a Hugging Face tokenizer.json describes, if it is one that minillm runs:
    GPT-2's byte-level split, SmolLM2's digits then byte-level, or a regex Split then byte-level (Llama 3,
    Qwen2 and most byte-level BPE models since); with no normalizer, or NFC."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    if norm is not None and norm.get("type") != "NFC":
        raise ValueError(f"{where}: normalizer {norm.get('type')!r} is not supported (none, or NFC)")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space") else None
    pattern = None
    if byte_level and len(steps) == 1 and byte_level.get("use_regex", True):
        pattern = GPT2
    elif byte_level and kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") \
            and byte_level.get("use_regex", True):
        pattern = SMOLLM
    elif byte_level and kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") \
            and "Regex" in steps[0].get("pattern", {}):
        pattern = steps[0]["pattern"]["Regex"]
    if pattern is None:
        raise ValueError(f"{where}: pre-tokenizer {' then '.join(map(str, kinds)) or 'none'} is not supported; "
                         "minillm runs byte-level BPE after GPT-2's split, digits, or one regex Split")
    return PreTokenizer("tokenizer.json", pattern, nfc=norm is not None)
