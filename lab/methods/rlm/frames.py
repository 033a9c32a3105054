"""Server-side checks of what the sandbox worker sends: every field of a worker frame is hostile.

`lab.methods.rlm.sandbox` passes each field through these before it reaches a `SubQuery`, an `ExecResult`, the
trace, a figure or an export: text is a `str` with no lone surrogates (they cannot be encoded as UTF-8, so a
trace holding one could not be written), counts are ints in a range, and ranges are at most `MAX_RANGES`
[start, end] pairs of ints clamped to the context (0 <= start <= end <= its length). A 4300-digit integer, a
negative offset, a reversed pair, a bool or a nested list never gets further than this module.
"""

from __future__ import annotations

MAX_RANGES = 200  # [start, end] pairs kept from one frame
TEXT_CAP = 2000  # characters kept of a field that should have been a string and was not
FINAL_CAP = 4000  # characters of a FINAL answer (the supervisor cuts it there too)


def clean_text(value: object) -> str:
    """`value` as text: a str is kept (lone surrogates become "?"), None is "", anything else is str()-ed and cut."""
    text = value if isinstance(value, str) else "" if value is None else str(value)[:TEXT_CAP]
    return text.encode("utf-8", "replace").decode("utf-8")


def count(value: object, high: int) -> int:
    """An int in [0, high] (not a bool); anything else is 0."""
    return min(max(value, 0), high) if type(value) is int else 0


def ranges(items: object, length: int) -> list[list[int]]:
    """At most MAX_RANGES [start, end] pairs of ints, each clamped into [0, length] and ordered; others dropped."""
    if not isinstance(items, list):
        return []
    pairs = [p for p in items[:MAX_RANGES] if isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)]
    clamped = [(min(max(a, 0), length), min(max(b, 0), length)) for a, b in pairs]
    return [[min(a, b), max(a, b)] for a, b in clamped]
