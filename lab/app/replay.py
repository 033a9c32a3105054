"""Replaying a recorded trace without a model: load an uploaded or shipped trace file safely, then step through it.

Covered: `load_trace_file` (the upload path: a size cap checked before reading, strict UTF-8, then
`lab.trace.from_json`, which validates JSON depth, version, event kinds and field types and never unpickles;
every failure is a `TraceError` whose message says what is wrong), `example_traces` (the shipped
examples/traces/*.json), and frames: a replay position is a prefix of the event list, cut where the step index
changes, so frame k shows exactly what the live view showed after the k-th step (`frame_cuts`, `events_at`,
`frame_of_step`), and token positions for keyboard stepping (`token_count`, `trace_at_token`).
Not covered: editing traces, or re-running a trace's request (that needs the model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lab.app.pacing import token_cuts
from lab.trace import Event, TokenEmitted, Trace, TraceError, from_json

MAX_UPLOAD_BYTES = 8_000_000
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "traces"


def load_trace_file(path: str | Path | None, max_bytes: int = MAX_UPLOAD_BYTES) -> Trace:
    """Read and validate a trace file; raises TraceError with a message a user can act on."""
    if not path:
        raise TraceError("no file was given; upload a trace (.json) saved by the lab")
    file = Path(path)
    try:
        size = file.stat().st_size
    except OSError:
        raise TraceError("the uploaded file cannot be read") from None
    if not file.is_file():
        raise TraceError("the upload is not a regular file")
    if size > max_bytes:
        raise TraceError(f"the file is {size:,} bytes; uploads are limited to {max_bytes:,} bytes")
    if size == 0:
        raise TraceError("the file is empty")
    data = file.read_bytes()[: max_bytes + 1]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceError(f"the file is not UTF-8 text (byte {error.start}); is it a trace JSON file?") from None
    return from_json(text)


def example_traces(folder: Path = EXAMPLES_DIR) -> list[tuple[str, str]]:
    """(label, path) of every shipped example trace, sorted by name; the label is the file name's stem."""
    if not folder.is_dir():
        return []
    return [(path.stem, str(path)) for path in sorted(folder.glob("*.json"))]


def frame_cuts(events: list[Event]) -> list[int]:
    """Prefix lengths of the replay frames: one frame per run of consecutive events with the same step (the
    stream order), plus the end. Frame 0 is the empty prefix."""
    cuts = [0]
    previous = object()
    for index, event in enumerate(events):
        step = getattr(event, "step", None)
        if index and step != previous:
            cuts.append(index)
        previous = step
    if events:
        cuts.append(len(events))
    return cuts


def frame_count(trace: Trace) -> int:
    """The last frame index (the slider's maximum): frame_count(trace) shows the whole trace."""
    return len(frame_cuts(trace.events)) - 1


def events_at(trace: Trace, frame: int) -> list[Event]:
    """The events shown at replay position `frame` (clamped to [0, frame_count])."""
    cuts = frame_cuts(trace.events)
    return trace.events[: cuts[max(0, min(int(frame), len(cuts) - 1))]]


def trace_at(trace: Trace, frame: int) -> Trace:
    """A copy of the trace holding only the events of replay position `frame`."""
    return dataclasses.replace(trace, events=events_at(trace, frame))


def token_count(trace: Trace) -> int:
    """Tokens in the trace: the last position of token-by-token stepping."""
    return sum(isinstance(e, TokenEmitted) for e in trace.events)


def trace_at_token(trace: Trace, k: int) -> Trace:
    """The trace as it was shown with its first `k` tokens (and the detail events that came with them); the
    whole trace at k >= token_count (keyboard stepping and paced playback use this position)."""
    k = max(0, int(k))
    if k >= token_count(trace):
        return trace
    cuts = token_cuts(trace.events)
    return dataclasses.replace(trace, events=trace.events[: cuts[k]])


def position_status(trace: Trace, shown: Trace, ended: str = "") -> str:
    """The stats' stop cell of a run shown in part (stepping, replay): "token k of n shown" before its end; at the
    end `ended` (e.g. "stopped by you"), or "" so the stats read the run's own stop reason."""
    total, k = token_count(trace), token_count(shown)
    if k < total or len(shown.events) < len(trace.events):
        return f"token {k} of {total} shown"
    return ended


def frame_of_step(trace: Trace, step: int) -> int:
    """The first frame at which an event of `step` is visible (the whole trace when no event has that step)."""
    cuts = frame_cuts(trace.events)
    for frame, cut in enumerate(cuts[1:], start=1):
        if any(getattr(e, "step", None) == step for e in trace.events[cuts[frame - 1] : cut]):
            return frame
    return len(cuts) - 1
