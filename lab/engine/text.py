"""Streaming detokenization: the text each new token adds, without splitting multi-byte characters."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decode a growing list of ids; `push(id)` returns only the newly completed text.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; that text is held back (decoded as
    U+FFFD) until the character completes, so joining every returned piece equals decoding the whole list.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted) :], text
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new
