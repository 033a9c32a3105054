"""The trace contract every strategy shares: the event-kind registry (`@event_kind`), `TokenEmitted` and
`RunFinished`, and `Event`, the type of any registered event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EVENT_KINDS: dict[str, type] = {}


class TraceError(ValueError):
    """A trace file is malformed, too large or of an unknown version; the message says which."""


def event_kind(cls: type) -> type:
    """Register a frozen event dataclass under its class name (the "kind" field in JSON)."""
    EVENT_KINDS[cls.__name__] = cls
    return cls


@event_kind
@dataclass(frozen=True)
class TokenEmitted:
    """One token appended to the output. `source` is its provenance: target (sampled or argmax from the
    target), accepted (a draft token the target accepted), recovered (resampled after a rejection) or bonus."""

    step: int
    token_id: int
    text: str
    source: str
    t: float  # seconds since the run started
    top_ids: list[int] = field(default_factory=list)  # alternatives at this step, most likely first
    top_tokens: list[str] = field(default_factory=list)
    top_probs: list[float] = field(default_factory=list)  # probabilities of the distribution sampled from


@event_kind
@dataclass(frozen=True)
class RunFinished:
    """The run ended: why, how long it took and how many forwards of each model it cost."""

    step: int
    stop_reason: str  # eos | max_new_tokens | cancelled | error
    wall_s: float
    prompt_tokens: int
    target_forwards: int
    draft_forwards: int = 0


Event = Any  # any registered event dataclass
