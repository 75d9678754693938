"""Structured output: a grammar decides which tokens may come next.

A request with a grammar (a JSON schema, "any JSON object", or a tool-call format) keeps a matcher:
a parser that has read the answer so far. Before each of its tokens is sampled, the matcher says which
tokens of the vocabulary could continue a valid answer, as a bitmask (one bit per token, 32 to a word).
Every other token's logit becomes -inf, so greedy decoding and sampling alike can only pick a token the
grammar allows; the chosen token is then fed to the matcher.

    logits (V,) --mask from the matcher--> logits with banned tokens at -inf --> sample --> matcher reads it

When the grammar accepts the answer as complete, the mask allows the end-of-text tokens, and once
nothing else can follow, only them: the answer ends there.

The parser is llguidance (the library vLLM and SGLang use too). It reads grammars in a Lark dialect
where `%json {schema}` embeds a JSON schema, and it computes a mask for SmolLM2's 49,152 tokens in tens
of microseconds (benchmarks/structured_output.py measures it against xgrammar).
"""
from __future__ import annotations

import json
import sys
from functools import lru_cache

import llguidance
import torch

from .json_schema import unsatisfiable
from .tokenizer import Tokenizer, byte_to_unicode


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token id's bytes: the vocabulary's GPT-2 stand-in characters turned back into bytes
    (special tokens: their own text)."""
    inverse = {c: b for b, c in byte_to_unicode().items()}
    special = set(tokenizer.special_tokens.values())
    return [t.encode() if i in special else bytes(inverse[c] for c in t) for i, t in enumerate(tokenizer.tokens)]


class _Vocabulary:
    """What llguidance asks of a tokenizer: the tokens' bytes, the end token, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokens = token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = None
        # special, for the grammar: never part of an answer's text (unused ids have none to give)
        self.special_token_ids = sorted({*tokenizer.special_tokens.values(), *tokenizer.unused_ids})
        self._tok = tokenizer

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tok.encode(text, allow_special=False)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance indexes it (a token trie: about 0.2 s, once per tokenizer)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                  eos_token=sorted(tokenizer.stop_ids))


# ------------------------------------------------------------ grammars
def json_schema_grammar(schema: dict | bool) -> str:
    """A grammar for JSON text that validates against `schema` (ValueError says what is wrong with it).
    Compact: no whitespace between tokens, as json.dumps(..., separators=(",", ":")) writes it."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object (or true/false); got {type(schema).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"the JSON schema is not valid: {e}") from None
    check_grammar(grammar, "JSON schema")
    if (why := unsatisfiable(schema)) is not None:     # valid, but its grammar could never end: refuse it now
        raise ValueError(f"the JSON schema cannot be satisfied: {why}")
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    """A grammar written in llguidance's Lark dialect (`%json {...}` embeds a JSON schema)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"the grammar does not compile: {e}") from None
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str, what: str = "grammar") -> None:
    """ValueError with the compiler's message if the grammar (made from `what`) is not valid."""
    if not isinstance(grammar, str):
        raise ValueError(f"a grammar is a string (from json_schema_grammar, lark_grammar); got {type(grammar).__name__}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the {what} is not valid: {error}")


# ------------------------------------------------------------ one request's matcher
class Constraint:
    """One sequence's parser state: the mask of its next token, and each token it writes."""

    def __init__(self, grammar: str, tokenizer: Tokenizer):
        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens into bitmask (words,) int32, bit t % 32 of word t // 32."""
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, token: int) -> bool:
        """Read one token of the answer; False if the grammar does not allow it (the matcher is then stuck)."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        """What stopped the parser, in one short line (its full state runs to many lines)."""
        if not self.matcher.is_error():
            return None
        lines = self.matcher.get_error().strip().splitlines() or ["the parser stopped"]
        return lines[0] if len(lines[0]) <= 200 else lines[0][:200] + "…"

    @property
    def done(self) -> bool:
        """Whether the answer so far is complete under the grammar."""
        return self.matcher.is_accepting()


@lru_cache(maxsize=4)
def _executor(threads: int) -> llguidance.LLExecutor:
    return llguidance.LLExecutor(num_threads=threads)


def fill_bitmasks(constraints: list[Constraint], bitmask: torch.Tensor) -> None:
    """Row i of bitmask (rows, words) <- the allowed next tokens of constraints[i], all rows at once,
    spread over as many threads as torch uses (on a 2-core Xeon, llguidance's default thread count took
    2x longer at batch 32)."""
    assert bitmask.is_contiguous() and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    threads = torch.get_num_threads()
    if len(constraints) == 1 or threads == 1:
        for i, c in enumerate(constraints):
            c.fill(bitmask[i])
        return
    _executor(threads).unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)],
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, len(constraints))


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """(rows, ceil(V / 32)) int32 bitmasks, in CPU memory (where the matcher writes)."""
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 -> (rows, V) bool: True where a token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)                 # (32,)
    allowed = (bitmask[:, :, None] >> bits) & 1                                        # (rows, words, 32)
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


@lru_cache(maxsize=8)
def _byte_bias(dtype: torch.dtype, device: str) -> torch.Tensor:
    """(256, 8): for each byte value, its 8 bits (lowest first) as logit biases, 0 where set, -inf where not."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1                        # (256, 8)
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)


def mask_bias(bitmask: torch.Tensor, vocab_size: int, dtype=torch.float32) -> torch.Tensor:
    """(rows, words) int32 -> (rows, V) biases: 0 for an allowed token, -inf for a banned one.
    Each byte of the mask picks its row of a 256-entry table: one lookup per 8 tokens, and no branch per
    token (masked_fill on a 49,152-wide row with half the bits set mispredicts every other one)."""
    assert sys.byteorder == "little"                    # token t is bit t % 8 of byte t // 8
    table = _byte_bias(dtype, str(bitmask.device))                                     # (256, 8)
    as_bytes = bitmask.view(torch.uint8).reshape(-1).int()                             # (rows * words * 4,)
    return table.index_select(0, as_bytes).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (rows, V), bitmask (rows, words) -> logits with every banned token at -inf."""
    return logits + mask_bias(bitmask.to(logits.device), logits.shape[-1], logits.dtype)


def schema_text(schema) -> str:
    """A schema as compact JSON text (what a prompt shows the model)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
