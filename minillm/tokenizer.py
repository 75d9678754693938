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

Pre-tokenization (how text is cut into words before BPE) is the family's own
(`pretokenize.py`): SmolLM2's tokenizer first splits every digit on its own
(llama.cpp calls it `smollm`), then applies the GPT-2 pattern inside each piece;
Llama 3 and Qwen2 cut differently. The chat template is the model's own Jinja
program (`chat_template.py`).

Other models' files are read the same way (`from_gguf`, `from_hf_folder`): a
byte-level BPE vocabulary, its merges, a pre-tokenizer minillm knows, and the
tokens that end a turn.
"""
from __future__ import annotations

import codecs
import json
import unicodedata
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken

from . import chat_template, pretokenize
from .pretokenize import PreTokenizer

# the tokens that end a turn or a text in the families minillm reads, besides the file's own end token
TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


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
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int = 0, name: str = "bpe",
                 pre: PreTokenizer = pretokenize.BY_GGUF_NAME["smollm"], template: str | None = None,
                 add_bos: bool = False, stop_ids=()):
        """token_types: GGUF's (1 normal, 3 control, 4 user-defined); template: the model's chat template
        (Jinja), None for a model without one; add_bos: a prompt given as text starts with bos_id
        (`encode_prompt`); stop_ids: ids besides eos_id that end a generation."""
        types = token_types or [1] * len(tokens)
        # Control and user-defined tokens (added tokens) are matched whole in text and never merged.
        self.special_tokens = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}
        inverse = {c: b for b, c in byte_to_unicode().items()}
        to_bytes = lambda s: bytes(inverse[c] for c in s)  # noqa: E731

        id_of = {t: i for i, t in enumerate(tokens)}
        ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
        rank_to_id = np.full(256 + len(merges), -1, dtype=np.int64)
        for b in range(256):
            rank_to_id[b] = id_of.get(byte_to_unicode()[b], -1)  # -1: byte not in the vocabulary
        for i, merge in enumerate(merges):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            ranks[to_bytes(left + right)] = 256 + i
            rank_to_id[256 + i] = id_of[left + right]
        # tiktoken's special ids live after the ranks; map them to the model's ids too.
        special_ranks = {t: len(rank_to_id) + j for j, t in enumerate(self.special_tokens)}
        rank_to_id = np.concatenate([rank_to_id, np.fromiter(self.special_tokens.values(), dtype=np.int64)])
        known = rank_to_id >= 0
        self._id_to_rank = np.full(len(tokens), -1, dtype=np.int64)
        self._id_to_rank[rank_to_id[known]] = np.flatnonzero(known)
        rank_to_id[~known] = unk_id  # a byte with no token of its own encodes as <unk>
        # ids with no bytes at all (a vocabulary padded past the tokenizer's): never text
        self.unused_ids = frozenset(np.flatnonzero(self._id_to_rank < 0).tolist())
        self._rank_to_id = rank_to_id
        self.pre = pre
        self.enc = tiktoken.Encoding(name=name, pat_str=pre.pattern,
                                     mergeable_ranks=ranks, special_tokens=special_ranks)
        self.tokens = tokens
        self.vocab_size = len(tokens)
        # the most bytes of text one token covers: a text of N bytes has at least N / this many tokens
        self.max_token_bytes = max([*map(len, ranks), *(len(t.encode()) for t in self.special_tokens)])
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.im_start_id = self.special_tokens.get("<|im_start|>")
        self.im_end_id = self.special_tokens.get("<|im_end|>")
        self.template, self.add_bos = template, add_bos
        self._stop_ids = {i for i in (eos_id, *stop_ids, *map(self.special_tokens.get, TURN_ENDS)) if i is not None}

    # ------------------------------------------------------------ encode / decode
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> model token ids. Special tokens written in the text (e.g. `<|im_end|>`)
        become their single id, as in the model's reference tokenizer; pass
        `allow_special=False` to encode them as ordinary text instead."""
        if self.pre.nfc:
            text = unicodedata.normalize("NFC", text)
        ranks = self.enc.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return self._rank_to_id[np.asarray(ranks, dtype=np.int64)].tolist()

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt given as text -> ids, starting with the BOS token where the model's tokenizer adds one
        (Llama 3), as transformers' `tokenizer(text)` and vLLM's completions do. (A chat template writes its
        own BOS: `apply_chat_template` encodes without adding one.)"""
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode_bytes(self, ids) -> bytes:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):    # (checked as Python ints: any size)
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {min(ids)}..{max(ids)}")
        ranks = self._id_to_rank[np.asarray(ids, dtype=np.int64)]
        return self.enc.decode_bytes(ranks[ranks >= 0].tolist())     # an unused id (padding) has no bytes

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
        """The model's own chat template (Jinja, from its file) rendered as transformers renders it."""
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be {{'role': 'system'|'user'|'assistant', 'content': str}}; got {m!r}")
        if self.template is None:
            raise ValueError("this model's file has no chat template: send a prompt as text (completions), "
                             "formatted as the model expects")
        name = lambda i: None if i is None else self.tokens[i]   # noqa: E731
        text = chat_template.render(self.template, [dict(m) for m in messages], add_generation_prompt,
                                    bos_token=name(self.bos_id), eos_token=name(self.eos_id),
                                    unk_token=name(self.unk_id))
        return self.encode(text) if tokenize else text

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end a generation: end of text and end of a chat turn."""
        return self._stop_ids

    # ------------------------------------------------------------ loading
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from .weights import gguf_reader

        reader = gguf_reader(Path(path).resolve())
        f = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
        if f("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{path}: tokenizer {f('tokenizer.ggml.model')!r} is not supported; minillm reads "
                             "byte-level BPE ('gpt2': SmolLM, Llama 3, Qwen), not SentencePiece ('llama': Llama 2, Mistral)")
        pre = pretokenize.from_gguf(f("tokenizer.ggml.pre"), str(path))
        return cls(f("tokenizer.ggml.tokens"), f("tokenizer.ggml.merges"), f("tokenizer.ggml.token_type"),
                   bos_id=f("tokenizer.ggml.bos_token_id"), eos_id=f("tokenizer.ggml.eos_token_id"),
                   unk_id=f("tokenizer.ggml.unknown_token_id") or 0, name=Path(path).stem, pre=pre,
                   template=f("tokenizer.chat_template"), add_bos=bool(f("tokenizer.ggml.add_bos_token")),
                   stop_ids=[i for i in (f("tokenizer.ggml.eot_token_id"), f("tokenizer.ggml.eom_token_id"))
                             if i is not None])

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "Tokenizer":
        """A Hugging Face folder's tokenizer.json (byte-level BPE), its tokenizer_config.json (chat template,
        special tokens) and generation_config.json (the ids that end a generation)."""
        folder = Path(folder)
        read = lambda name: json.loads((folder / name).read_text(encoding="utf-8")) \
            if (folder / name).is_file() else {}  # noqa: E731
        spec, config, generation = read("tokenizer.json"), read("tokenizer_config.json"), read("generation_config.json")
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
                or model.get("end_of_word_suffix"):
            raise ValueError(f"{folder}: {'no tokenizer.json' if not spec else 'its tokenizer is not byte-level BPE'}; "
                             "minillm reads byte-level BPE tokenizers (SmolLM, Llama 3, Qwen)")
        pre = pretokenize.from_tokenizer_json(spec, f"{folder / 'tokenizer.json'}")
        added = {t["content"]: t for t in spec.get("added_tokens", [])}
        ids = {**model["vocab"], **{t: a["id"] for t, a in added.items()}}
        # the model's vocabulary may be larger than the tokenizer's (Qwen pads it): unused ids, as llama.cpp names them
        n = max(max(ids.values()) + 1, read("config.json").get("vocab_size") or 0)
        tokens = [f"[PAD{i}]" for i in range(n)]
        for t, i in ids.items():
            tokens[i] = t
        types = [(3 if added[t]["special"] else 4) if t in added else 1 if t in ids else 5 for t in tokens]
        token = lambda key: (v.get("content") if isinstance(v := config.get(key), dict) else v)  # noqa: E731
        id_of = lambda key: ids.get(token(key))  # noqa: E731
        template = config.get("chat_template")
        if isinstance(template, list):          # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        eos = generation.get("eos_token_id")
        return cls(tokens, model["merges"], types, bos_id=id_of("bos_token"), eos_id=id_of("eos_token"),
                   unk_id=id_of("unk_token") or 0, name=folder.name, pre=pre, template=template,
                   add_bos=_adds_bos(spec.get("post_processor"), id_of("bos_token")),
                   stop_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [])


def _adds_bos(post: dict | None, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor puts the BOS token before a single text (Llama 3 does)."""
    if not post or bos_id is None:
        return False
    if post.get("type") == "Sequence":
        return any(_adds_bos(p, bos_id) for p in post.get("processors", []))
    if post.get("type") == "TemplateProcessing" and post.get("single"):
        first = post["single"][0].get("SpecialToken", {}).get("id")
        return first is not None and bos_id in post.get("special_tokens", {}).get(first, {}).get("ids", [])
    return False


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
