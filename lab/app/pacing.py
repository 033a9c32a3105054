"""Teach-at-your-pace: release a run's buffered events at a chosen speed without slowing the model.

Covered: `PaceControl` (the pace a viewer picked: real time, N tokens per second, or one token per click; changed
while a run streams from another request thread, so it is locked), `Pacer.visible(events, now)` (how many of the
events that arrived so far are shown at time `now`: a prefix that ends after the released tokens, with the detail
events that follow a token shown with it), and `PaceRegistry` (the controls of live runs by session, so a speed
change, a Step click or Stop reaches the run that is streaming; entries expire). The model keeps running at full speed
into the buffer; only the release is paced. When the model is slower than the pace, tokens are shown as they
arrive (no catch-up burst). Not covered: pacing of non-token events alone (they ride with the tokens).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from lab.trace import Event, TokenEmitted

REALTIME = "real time"
STEP = "step on click"
PACES = {REALTIME: None, "4 tokens/s": 4.0, "1 token/s": 1.0, STEP: 0.0}
REGISTRY_TTL_S = 3600


@dataclass
class PaceControl:
    """The chosen pace (a key of PACES) and, in step mode, how many tokens the viewer has released."""

    pace: str = REALTIME
    released: int = 0
    live: bool = False  # a run of this session is streaming (Step clicks release its tokens)
    stop_requested: bool = False  # the viewer pressed Stop: the live run ends as a result (not an error)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_pace(self, pace: str) -> None:
        with self.lock:
            self.pace = pace if pace in PACES else REALTIME

    def step(self, by: int = 1) -> None:
        with self.lock:
            self.released = max(0, self.released + by)

    def request_stop(self) -> None:
        with self.lock:
            self.stop_requested = True

    def snapshot(self) -> tuple[str, int]:
        with self.lock:
            return self.pace, self.released


def token_cuts(events: list[Event]) -> list[int]:
    """cuts[k] = length of the shortest prefix holding k tokens plus the detail events that follow the k-th
    token (before the next token); cuts[0] = events before the first token."""
    positions = [i for i, e in enumerate(events) if isinstance(e, TokenEmitted)]
    return positions + [len(events)]


class Pacer:
    """Decides the visible prefix of a growing event list under a PaceControl."""

    def __init__(self, control: PaceControl, start: float | None = None) -> None:
        self.control = control
        self.shown = 0  # tokens released
        self.next_at = time.monotonic() if start is None else start

    def visible(self, events: list[Event], now: float, arrived_all: bool = False) -> int:
        """Number of leading events shown at `now` (all of them in real time)."""
        cuts = token_cuts(events)
        available = len(cuts) - 1  # tokens arrived
        pace, released = self.control.snapshot()
        rate = PACES.get(pace)
        if rate is None:
            self.shown = available
            return len(events)
        if rate == 0.0:
            self.shown = min(released, available)
        else:
            interval = 1.0 / rate
            while self.shown < available and now >= self.next_at:
                self.shown += 1
                self.next_at = max(self.next_at + interval, now)
            if self.shown >= available and now > self.next_at:
                self.next_at = now  # the model is slower than the pace: show the next token when it arrives
        if self.shown >= available and arrived_all:
            return len(events)
        return cuts[self.shown]

    def caught_up(self, events: list[Event]) -> bool:
        return self.shown >= len(token_cuts(events)) - 1


class PaceRegistry:
    """PaceControls of the sessions that have a live run (keyed by session id), expiring after a while."""

    def __init__(self, ttl_s: float = REGISTRY_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._controls: dict[str, tuple[PaceControl, float]] = {}

    def get(self, session: str) -> PaceControl:
        """The session's control (created on first use)."""
        now = time.monotonic()
        with self._lock:
            self._controls = {k: v for k, v in self._controls.items() if now - v[1] < self.ttl_s}
            control = self._controls.get(session, (PaceControl(), now))[0]
            self._controls[session] = (control, now)
            return control
