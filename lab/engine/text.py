"""Streaming detokenization (the text each new token adds, without splitting multi-byte characters) and model
text made safe to print on a terminal."""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL and the C1 controls: ESC starts an escape sequence (OSC 52 writes the
# clipboard, others hide or rewrite text), U+009B / U+009D are 8-bit CSI / OSC, CR overwrites the line
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
RAW_IN_JSON = re.compile("[\x7f-\x9f]")  # what json.dumps(ensure_ascii=False) leaves unescaped of CONTROLS


def printable(text: str) -> str:
    """`text` without control characters other than newline and tab (model output, before a terminal sees it)."""
    return CONTROLS.sub("", text)


def json_for_terminal(dumped: str) -> str:
    """A json.dumps(..., ensure_ascii=False) result with DEL and the C1 controls written as \\u escapes too (the
    C0 ones are escaped already): the same JSON value, nothing a terminal acts on."""
    return RAW_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", dumped)


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
