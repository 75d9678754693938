"""The model's own byte-level BPE tokenizer, run by tiktoken.

A GGUF file carries the vocabulary (49,152 token strings) and the merge list
(48,900 pairs, in priority order). tiktoken wants something slightly different:
`mergeable_ranks`, a map from byte strings to ranks, where a lower rank merges
first. We build it as

    rank 0..255          the 256 single bytes
    rank 256 + i         the token made by merge i

and keep a rank -> model id table beside it, because the model's ids are not
ranks: its first 17 ids are special tokens, and only 235 of the 256 single
bytes have an id (merge i yields id 252 + i in SmolLM2's vocabulary).

Pre-tokenization (how text is cut into words before BPE): SmolLM2's tokenizer
first splits every digit on its own (llama.cpp calls it `smollm`), then applies
the GPT-2 pattern inside each piece. `PRETOKENIZE_PATTERN` does both in one
regex: digits are single-character words, and a whitespace run just before a
digit ends there, as it would at the end of a piece.
"""
from __future__ import annotations

import codecs
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken

# GPT-2's pattern with `\p{N}` alone (one digit per word) and whitespace stopping before digits.
PRETOKENIZE_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (space -> 'Ġ', newline -> 'Ċ', ...)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """encode / decode / chat template for a byte-level BPE vocabulary."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int = 0, name: str = "bpe"):
        types = token_types or [1] * len(tokens)
        # Special ("control") tokens are matched whole in text and never merged.
        self.special_tokens = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3}
        inverse = {c: b for b, c in byte_to_unicode().items()}
        to_bytes = lambda s: bytes(inverse[c] for c in s)  # noqa: E731

        id_of = {t: i for i, t in enumerate(tokens)}
        ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
        rank_to_id = np.full(256 + len(merges), -1, dtype=np.int64)
        for b in range(256):
            rank_to_id[b] = id_of.get(byte_to_unicode()[b], -1)  # -1: byte not in the vocabulary
        for i, merge in enumerate(merges):
            left, right = merge.split(" ", 1)
            ranks[to_bytes(left + right)] = 256 + i
            rank_to_id[256 + i] = id_of[left + right]
        # tiktoken's special ids live after the ranks; map them to the model's ids too.
        special_ranks = {t: len(rank_to_id) + j for j, t in enumerate(self.special_tokens)}
        rank_to_id = np.concatenate([rank_to_id, np.fromiter(self.special_tokens.values(), dtype=np.int64)])
        known = rank_to_id >= 0
        self._id_to_rank = np.full(len(tokens), -1, dtype=np.int64)
        self._id_to_rank[rank_to_id[known]] = np.flatnonzero(known)
        rank_to_id[~known] = unk_id  # a byte with no token of its own encodes as <unk>
        self._rank_to_id = rank_to_id
        self.enc = tiktoken.Encoding(name=name, pat_str=PRETOKENIZE_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=special_ranks)
        self.tokens = tokens
        self.vocab_size = len(tokens)
        # the most bytes of text one token covers: a text of N bytes has at least N / this many tokens
        self.max_token_bytes = max([*map(len, ranks), *(len(t.encode()) for t in self.special_tokens)])
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.im_start_id = self.special_tokens.get("<|im_start|>")
        self.im_end_id = self.special_tokens.get("<|im_end|>")

    # ------------------------------------------------------------ encode / decode
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> model token ids. Special tokens written in the text (e.g. `<|im_end|>`)
        become their single id, as in the model's reference tokenizer; pass
        `allow_special=False` to encode them as ordinary text instead."""
        ranks = self.enc.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return self._rank_to_id[np.asarray(ranks, dtype=np.int64)].tolist()

    def decode_bytes(self, ids) -> bytes:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):    # (checked as Python ints: any size)
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {min(ids)}..{max(ids)}")
        return self.enc.decode_bytes(self._id_to_rank[np.asarray(ids, dtype=np.int64)].tolist())

    def decode(self, ids) -> str:
        """Model token ids -> text (invalid UTF-8 becomes U+FFFD, as in the reference)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        """The vocabulary string of one id (bytes shown GPT-2 style, 'Ġ' for a space)."""
        return self.tokens[i]

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True):
        """ChatML, as in SmolLM2's template: a default system message if none is given."""
        parts = []
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be {{'role': 'system'|'user'|'assistant', 'content': str}}; got {m!r}")
            if i == 0 and m["role"] != "system":
                parts.append("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end a generation: end of text and end of a chat turn."""
        return {i for i in (self.eos_id, self.im_end_id, self.special_tokens.get("<|endoftext|>")) if i is not None}

    # ------------------------------------------------------------ loading
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from .weights import gguf_reader

        reader = gguf_reader(Path(path).resolve())
        f = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
        if f("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{path}: tokenizer {f('tokenizer.ggml.model')!r} is not byte-level BPE (gpt2)")
        if f("tokenizer.ggml.pre") not in ("smollm", None):
            raise ValueError(f"{path}: pre-tokenizer {f('tokenizer.ggml.pre')!r} is not supported (only 'smollm')")
        return cls(f("tokenizer.ggml.tokens"), f("tokenizer.ggml.merges"), f("tokenizer.ggml.token_type"),
                   bos_id=f("tokenizer.ggml.bos_token_id"), eos_id=f("tokenizer.ggml.eos_token_id"),
                   unk_id=f("tokenizer.ggml.unknown_token_id") or 0, name=Path(path).stem)


class StreamDecoder:
    """Turns ids into text as they arrive, never emitting half a UTF-8 character.

    A character such as '€' (3 bytes) or an emoji (4 bytes) may be split across
    tokens; the incremental decoder holds the incomplete bytes until the rest come.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tok.decode_bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
