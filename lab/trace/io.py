"""The versioned JSON trace file: `Trace`, `to_json`, `from_json` (checks size, nesting depth, version, every
event kind and every field's type; never unpickles)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from lab.trace.base import EVENT_KINDS, Event, TokenEmitted, TraceError

TRACE_FORMAT = "decoding-lab-trace"


TRACE_VERSION = 1


MAX_TRACE_BYTES = 20_000_000


MAX_EVENTS = 200_000


MAX_DEPTH = 8


@dataclass
class Trace:
    """A recorded run: what was asked and every event the strategy emitted."""

    strategy: str
    model: str
    prompt: str
    params: dict
    events: list[Event] = field(default_factory=list)
    dtype: str = ""  # e.g. bfloat16 ("" when not recorded)
    precision: str = ""  # weight format of the linears: bf16 (float weights), int8, int4, w4a8 or a requested "auto"
    choice: str = ""  # how dtype and precision were chosen, and why ("" when not recorded)
    # where this run branched from another (lab.app.branching.branch_record); None for a run from the prompt
    branch: dict | None = None
    # the target's forward path for the whole run (lab.engine.forward_path: name, reason, row_invariant); None when
    # not recorded (older traces, runs whose model loads elsewhere)
    forward_path: dict | None = None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEmitted))

    @property
    def token_ids(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEmitted)]


def event_to_dict(event: Event) -> dict:
    return {"kind": type(event).__name__, **dataclasses.asdict(event)}


def to_json(trace: Trace) -> str:
    """Serialize a trace to the versioned JSON format."""
    payload = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "strategy": trace.strategy,
        "model": trace.model,
        "prompt": trace.prompt,
        "params": trace.params,
        "events": [event_to_dict(e) for e in trace.events],
    }
    payload |= {key: value for key in ("dtype", "precision", "choice") if (value := getattr(trace, key))}
    if trace.branch is not None:  # optional: traces without it (all older ones) load as before
        payload["branch"] = trace.branch
    if trace.forward_path is not None:  # optional too
        payload["forward_path"] = trace.forward_path
    return json.dumps(payload, ensure_ascii=False, allow_nan=False)


def _depth(value: Any, limit: int, level: int = 0) -> None:
    if level > limit:
        raise TraceError(f"trace is nested deeper than {limit} levels")
    if isinstance(value, dict):
        for item in value.values():
            _depth(item, limit, level + 1)
    elif isinstance(value, list):
        for item in value:
            _depth(item, limit, level + 1)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # a huge JSON integer
        return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in a trace")


def _check_type(value: Any, hint: Any, where: str) -> None:
    """Check one JSON value against a field annotation (int, float, str, bool, list[...], X | None, dict)."""
    text = str(hint)
    if "None" in text and value is None:
        return
    if text.startswith("list"):
        if not isinstance(value, list):
            raise TraceError(f"{where}: expected a list")
        inner = hint.__args__[0] if getattr(hint, "__args__", None) else Any
        for i, item in enumerate(value):
            _check_type(item, inner, f"{where}[{i}]")
        return
    if hint is Any or text.startswith("dict"):
        return
    base = next((t for t in (bool, int, float, str) if t.__name__ in text), None)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value),
        str: isinstance(value, str),
    }.get(base, True)
    if not ok:
        expected = getattr(hint, "__name__", text)
        got = "a non-finite number" if base is float and isinstance(value, (int, float)) else type(value).__name__
        raise TraceError(f"{where}: expected {expected}, got {got}")


def event_from_dict(data: Any, index: int) -> Event:
    """Validate and build one event from its JSON object."""
    if not isinstance(data, dict):
        raise TraceError(f"events[{index}] is not an object")
    kind = data.get("kind")
    cls = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceError(f"events[{index}]: unknown event kind {kind!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(data) - set(fields) - {"kind"}
    if extra:
        raise TraceError(f"events[{index}] ({kind}): unknown fields {sorted(extra)}")
    values = {}
    for name, spec in fields.items():
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise TraceError(f"events[{index}] ({kind}): missing field {name!r}")
            continue
        _check_type(data[name], hints[name], f"events[{index}].{name}")
        values[name] = data[name]
    return cls(**values)


def from_json(text: str | bytes) -> Trace:
    """Load a trace file, rejecting anything oversized, too deep, of another version or not matching the schema."""
    size = len(text) if isinstance(text, (bytes, bytearray)) else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"trace is {size} bytes; the limit is {MAX_TRACE_BYTES}")
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:
        raise TraceError(f"not valid JSON: {error}") from None
    _depth(payload, MAX_DEPTH)
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise TraceError(f"not a Decoding Lab trace (expected format {TRACE_FORMAT!r})")
    version = payload.get("version")
    if type(version) is not int or version != TRACE_VERSION:
        raise TraceError(f"unsupported trace version {payload.get('version')!r}; this lab reads {TRACE_VERSION}")
    for key, kind in (("strategy", str), ("model", str), ("prompt", str), ("params", dict), ("events", list)):
        if not isinstance(payload.get(key), kind):
            raise TraceError(f"field {key!r} must be a {kind.__name__}")
    if len(payload["events"]) > MAX_EVENTS:
        raise TraceError(f"trace has {len(payload['events'])} events; the limit is {MAX_EVENTS}")
    for key, limit in (("dtype", 40), ("precision", 40), ("choice", 400)):
        if not isinstance(payload.get(key, ""), str) or len(payload.get(key, "")) > limit:
            raise TraceError(f"field {key!r} must be a string of at most {limit} characters")
    branch = payload.get("branch")
    if branch is not None and not isinstance(branch, dict):
        raise TraceError("field 'branch' must be an object")
    path = payload.get("forward_path")
    if path is not None and not (isinstance(path, dict) and isinstance(path.get("name"), str)):
        raise TraceError("field 'forward_path' must be an object with a string 'name'")
    events = [event_from_dict(item, i) for i, item in enumerate(payload["events"])]
    trace = Trace(payload["strategy"], payload["model"], payload["prompt"], payload["params"], events, branch=branch)
    trace.forward_path = path
    trace.dtype, trace.precision = payload.get("dtype", ""), payload.get("precision", "")
    trace.choice = payload.get("choice", "")
    return trace
