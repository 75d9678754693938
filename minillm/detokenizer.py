"""One sequence's sampled tokens in; its text out, and the moment it ends.

Every way of generating uses this, so a sequence ends the same way everywhere (the single-stream
loop, static batches, speculative decoding, the engine and, through it, the server):

    end token (unless ignore_eos)   finish "stop"; the end token is not kept
    a stop string appears           finish "stop"; the text is cut where it starts (the token that
                                    completed it is kept, as vLLM does)
    max_new tokens kept             finish "length"

Text is decoded a token at a time (`StreamDecoder`: never half a character). While a sequence runs,
its last `hold` characters are held back: they could be the start of a stop string, and text once
shown cannot be taken back.
"""
from __future__ import annotations


def first_stop(text: str, stops) -> int:
    """Where the earliest stop string starts in text, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params, max_new: int):
        """params: the SamplingParams (stop, ignore_eos). max_new: tokens allowed (max_tokens, or less
        where the context ends first)."""
        self.decoder = tokenizer.stream_decoder()
        self.stop_ids = frozenset() if params.ignore_eos else frozenset(tokenizer.stop_ids)
        self.stops = tuple(params.stop)
        self.hold = max(map(len, self.stops), default=1) - 1   # characters that could start a stop string
        self.max_new = max_new
        self.token_ids: list[int] = []    # kept tokens (append-only)
        self.text = ""                    # their text (cut before a stop string)
        self.finish_reason: str | None = None
        self._shown = 0                   # characters handed out by take()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """New tokens still allowed."""
        return self.max_new - len(self.token_ids)

    def push(self, token: int) -> None:
        """Take one sampled token (after the sequence is done: an error)."""
        assert not self.done, "the sequence has ended"
        if token in self.stop_ids:
            self._finish("stop")
            return
        self.token_ids.append(token)
        before = len(self.text)
        self.text += self.decoder.push(token)
        if self.stops:
            start = max(0, before - self.hold)        # a stop string seen now starts no earlier than this
            cut = first_stop(self.text[start:], self.stops)
            if cut >= 0:
                self.text, self.finish_reason = self.text[:start + cut], "stop"
                return
        if len(self.token_ids) >= self.max_new:
            self._finish("length")

    def _finish(self, reason: str) -> None:
        self.text += self.decoder.flush()             # bytes of an unfinished character, as U+FFFD
        self.finish_reason = reason

    @property
    def visible_len(self) -> int:
        """How much of `text` can be shown now: all of it once done, else all but the held-back tail."""
        return len(self.text) if self.done else max(0, len(self.text) - self.hold)

    def take(self, everything: bool = False) -> str:
        """The text that became showable since the last take(); everything: all the rest (the sequence
        was ended from outside: aborted, or failed)."""
        end = len(self.text) if everything else self.visible_len
        new, self._shown = self.text[self._shown:end], max(self._shown, end)
        return new
