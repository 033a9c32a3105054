"""Trace events: JSON round trip, the statistics fold, and a loader that rejects every malformed input with
TraceError (never another exception, never an unpickle)."""

from __future__ import annotations

import copy
import json

import pytest

from lab import trace as trace_module
from lab.trace import (
    MAX_EVENTS,
    MAX_TRACE_BYTES,
    TRACE_FORMAT,
    TRACE_VERSION,
    RunFinished,
    Stats,
    TokenEmitted,
    Trace,
    TraceError,
    from_json,
    summarize,
    to_json,
)


def token(step: int, token_id: int, text: str, t: float, source: str = "target") -> TokenEmitted:
    return TokenEmitted(step, token_id, text, source, t, [token_id, 7], [text, "x"], [0.75, 0.125])


def sample_trace() -> Trace:
    events = [
        token(0, 101, "Hel", 0.25),
        token(1, 102, "lo", 0.5),
        token(1, 103, " café", 0.5, source="accepted"),
        token(2, 104, " 日本🙂", 1.0, source="bonus"),
        RunFinished(step=3, stop_reason="max_new_tokens", wall_s=2.0, prompt_tokens=12, target_forwards=3),
    ]
    return Trace("greedy", "smollm2-135m", "Say hi ✨", {"max_new_tokens": 4, "temperature": 0.5}, events)


def valid_payload() -> dict:
    return json.loads(to_json(sample_trace()))


# --- round trip and folds ----------------------------------------------------------------------------------


def test_round_trip() -> None:
    original = sample_trace()
    text = to_json(original)
    loaded = from_json(text)
    assert loaded == original
    assert loaded.events[0] == original.events[0]
    assert isinstance(loaded.events[-1], RunFinished)
    assert loaded.text == "Hello café 日本🙂"
    assert loaded.token_ids == [101, 102, 103, 104]
    assert from_json(text.encode("utf-8")) == original
    assert to_json(loaded) == text


def test_json_layout() -> None:
    payload = valid_payload()
    assert payload["format"] == TRACE_FORMAT
    assert payload["version"] == TRACE_VERSION
    assert payload["events"][0]["kind"] == "TokenEmitted"
    assert payload["events"][-1] == {
        "kind": "RunFinished",
        "step": 3,
        "stop_reason": "max_new_tokens",
        "wall_s": 2.0,
        "prompt_tokens": 12,
        "target_forwards": 3,
        "draft_forwards": 0,
    }


def test_optional_fields_may_be_omitted() -> None:
    payload = valid_payload()
    for key in ("top_ids", "top_tokens", "top_probs"):
        del payload["events"][0][key]
    del payload["events"][-1]["draft_forwards"]
    loaded = from_json(json.dumps(payload))
    assert loaded.events[0].top_ids == []
    assert loaded.events[-1].draft_forwards == 0


def test_summarize_finished_run() -> None:
    stats = summarize(sample_trace().events)
    assert stats == Stats(
        new_tokens=4,
        wall_s=2.0,
        tokens_per_s=2.0,
        target_forwards=3,
        forwards_per_token=0.75,
        stop_reason="max_new_tokens",
    )
    assert stats.as_dict()["tokens_per_s"] == 2.0


def test_summarize_mid_run_without_run_finished() -> None:
    events = sample_trace().events[:-1]  # still running: time and forwards come from the tokens
    stats = summarize(events)
    assert stats.new_tokens == 4
    assert stats.wall_s == 1.0  # t of the latest token
    assert stats.tokens_per_s == 4.0
    assert stats.target_forwards == 3  # distinct steps
    assert stats.forwards_per_token == 0.75
    assert stats.stop_reason == "running"


def test_summarize_empty_and_zero_time() -> None:
    assert summarize([]) == Stats(0, 0.0, 0.0, 0, 0.0, "running")
    stats = summarize([token(0, 1, "a", 0.0)])
    assert stats.tokens_per_s == 0.0 and stats.new_tokens == 1 and stats.forwards_per_token == 1.0
    finished = summarize([RunFinished(0, "eos", 0.5, 3, 1)])
    assert finished.new_tokens == 0 and finished.forwards_per_token == 0.0 and finished.stop_reason == "eos"


# --- malformed inputs ----------------------------------------------------------------------------------------


def mutated(change) -> str:
    payload = copy.deepcopy(valid_payload())
    change(payload)
    return json.dumps(payload)


def set_event(index: int, key: str, value) -> callable:
    def change(payload: dict) -> None:
        payload["events"][index][key] = value

    return change


def del_event(index: int, key: str) -> callable:
    def change(payload: dict) -> None:
        del payload["events"][index][key]

    return change


def set_top(key: str, value) -> callable:
    def change(payload: dict) -> None:
        payload[key] = value

    return change


MALFORMED = {
    "not-json": ("{not json", "JSON"),
    "empty": ("", "JSON"),
    "truncated": (to_json(sample_trace())[:-5], "JSON"),
    "a-list": ("[1, 2, 3]", "format"),
    "a-number": ("42", "format"),
    "wrong-format": (mutated(set_top("format", "other-trace")), "format"),
    "missing-format": (mutated(lambda p: p.pop("format")), "format"),
    "wrong-version": (mutated(set_top("version", 2)), "version"),
    "version-string": (mutated(set_top("version", "1")), "version"),
    "missing-version": (mutated(lambda p: p.pop("version")), "version"),
    "strategy-not-str": (mutated(set_top("strategy", 5)), "strategy"),
    "params-not-object": (mutated(set_top("params", [1])), "params"),
    "events-not-list": (mutated(set_top("events", {"0": {}})), "events"),
    "missing-events": (mutated(lambda p: p.pop("events")), "events"),
    "event-not-object": (mutated(lambda p: p["events"].append(5)), "events[5]"),
    "unknown-kind": (mutated(set_event(0, "kind", "Nope")), "Nope"),
    "missing-kind": (mutated(del_event(0, "kind")), "kind"),
    "kind-not-str": (mutated(set_event(0, "kind", ["TokenEmitted"])), "kind"),
    "class-kind": (mutated(set_event(0, "kind", "__class__")), "__class__"),
    "extra-field": (mutated(set_event(0, "secret", 1)), "secret"),
    "dunder-field": (mutated(set_event(0, "__class__", "os.system")), "__class__"),
    "missing-field": (mutated(del_event(0, "token_id")), "token_id"),
    "missing-run-field": (mutated(del_event(4, "wall_s")), "wall_s"),
    "str-for-int": (mutated(set_event(0, "step", "3")), "step"),
    "bool-for-int": (mutated(set_event(0, "token_id", True)), "token_id"),
    "float-for-int": (mutated(set_event(0, "step", 1.5)), "step"),
    "null-for-int": (mutated(set_event(0, "step", None)), "step"),
    "int-for-str": (mutated(set_event(0, "text", 5)), "text"),
    "str-for-float": (mutated(set_event(0, "t", "fast")), "events[0].t"),
    "bool-for-float": (mutated(set_event(4, "wall_s", False)), "wall_s"),
    "str-for-list": (mutated(set_event(0, "top_ids", "abc")), "top_ids"),
    "bad-list-item": (mutated(set_event(0, "top_ids", [1, "2"])), "top_ids[1]"),
    "nested-list-item": (mutated(set_event(0, "top_ids", [1, [2]])), "top_ids[1]"),
    "bool-list-item": (mutated(set_event(0, "top_probs", [0.5, True])), "top_probs[1]"),
    "nan-float": (to_json(sample_trace()).replace('"t": 0.25', '"t": NaN'), ("events[0].t", "NaN")),
    "inf-float": (to_json(sample_trace()).replace('"wall_s": 2.0', '"wall_s": Infinity'), ("wall_s", "Infinity")),
    "neg-inf-in-list": (
        to_json(sample_trace()).replace("[0.75, 0.125]", "[0.75, -Infinity]", 1),
        ("top_probs[1]", "Infinity"),
    ),
    "too-deep": (mutated(set_top("params", {"a": [[[[[[[[[[1]]]]]]]]]]})), "deep"),
    "hostile-object": ('{"__class__": "subprocess.Popen", "args": ["rm", "-rf", "/"]}', "format"),
    "pickle-bytes": (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00.", "JSON"),
    "invalid-utf8": (b'{"format": "\xff\xfe"}', "JSON"),
}


@pytest.mark.parametrize("text, needle", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_inputs_raise_trace_error(text: str | bytes, needle: str | tuple[str, ...]) -> None:
    """Each malformed input is a TraceError whose message names the offending part (any of `needle`)."""
    with pytest.raises(TraceError) as info:
        from_json(text)
    message = str(info.value).lower()
    needles = (needle,) if isinstance(needle, str) else needle
    assert any(n.lower() in message for n in needles), message


@pytest.mark.parametrize("opener, closer", [("[", "]"), ('{"a":', "}")], ids=["lists", "objects"])
def test_extremely_deep_nesting_is_a_trace_error(opener: str, closer: str) -> None:
    text = opener * 10_000 + "1" + closer * 10_000
    with pytest.raises(TraceError):
        from_json(text)
    payload = valid_payload()
    payload["params"] = {"x": None}
    inner = json.dumps(payload).replace('{"x": null}', opener * 10_000 + "1" + closer * 10_000)
    with pytest.raises(TraceError):
        from_json(inner)


def test_moderately_deep_nesting_is_rejected_by_the_depth_limit() -> None:
    payload = valid_payload()
    payload["params"] = {"x": json.loads("[" * 500 + "]" * 500)}
    with pytest.raises(TraceError, match="deeper"):
        from_json(json.dumps(payload))


def test_oversized_trace_is_rejected_before_parsing() -> None:
    text = " " * (MAX_TRACE_BYTES + 1)
    with pytest.raises(TraceError, match="limit"):
        from_json(text)
    with pytest.raises(TraceError, match="limit"):
        from_json(text.encode())


def test_oversized_in_utf8_bytes_is_rejected_for_str_input() -> None:
    """MAX_TRACE_BYTES is a byte limit: a str of fewer characters but more UTF-8 bytes is over it too."""
    payload = valid_payload()
    payload["prompt"] = "日" * (MAX_TRACE_BYTES // 3 + 10)  # 3 bytes per character
    text = json.dumps(payload, ensure_ascii=False)
    assert len(text) < MAX_TRACE_BYTES < len(text.encode("utf-8"))
    with pytest.raises(TraceError, match="limit"):
        from_json(text.encode("utf-8"))  # bytes: rejected
    with pytest.raises(TraceError, match="limit"):
        from_json(text)  # the same trace as str


def test_too_many_events() -> None:
    payload = valid_payload()
    payload["events"] = [{}] * (MAX_EVENTS + 1)
    with pytest.raises(TraceError, match="events"):
        from_json(json.dumps(payload))


def test_many_valid_events_load() -> None:
    payload = valid_payload()
    payload["events"] = payload["events"][:1] * 1_000
    assert len(from_json(json.dumps(payload)).events) == 1_000


def test_huge_integer_in_float_field_is_a_trace_error() -> None:
    """JSON integers are unbounded; a 400-digit one in a float field must not escape as OverflowError."""
    text = to_json(sample_trace()).replace('"t": 0.25', '"t": 1' + "0" * 400)
    with pytest.raises(TraceError, match="events"):
        from_json(text)
    text = to_json(sample_trace()).replace("[0.75, 0.125]", "[0.75, 1" + "0" * 400 + "]", 1)
    with pytest.raises(TraceError, match="top_probs"):
        from_json(text)


def test_bool_version_is_a_trace_error() -> None:
    """true == 1 in Python; the version check must not accept a boolean."""
    with pytest.raises(TraceError, match="version"):
        from_json(mutated(set_top("version", True)))


def test_nan_anywhere_is_rejected() -> None:
    """The writer uses allow_nan=False; a loaded trace must be writable again, so NaN in params is rejected."""
    text = to_json(sample_trace()).replace('"temperature": 0.5', '"temperature": NaN')
    with pytest.raises(TraceError):
        from_json(text)


def test_loaded_traces_can_be_written_again() -> None:
    """Whatever from_json accepts, to_json writes (a property check over the valid payloads used above)."""
    for text in (to_json(sample_trace()), mutated(del_event(0, "top_ids"))):
        assert from_json(to_json(from_json(text))) == from_json(text)


def test_event_kinds_registry() -> None:
    assert trace_module.EVENT_KINDS["TokenEmitted"] is TokenEmitted
    assert trace_module.EVENT_KINDS["RunFinished"] is RunFinished
    assert "Trace" not in trace_module.EVENT_KINDS and "Stats" not in trace_module.EVENT_KINDS
