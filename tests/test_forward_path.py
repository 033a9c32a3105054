"""`lab.engine.forward_path`: one decision per run (a build that finishes mid-run does not switch paths), the
reasons, the trace field, the bench row field and `python -m lab doctor` (tiny random Llamas; no timing)."""

from __future__ import annotations

import json

import pytest
import torch

from lab.app.runner import new_trace, path_of
from lab.app.validation import validate_request
from lab.engine import forward_path, invariance, lean_forward, native_forward, runtime
from lab.engine.forward_path import LEAN, MODEL, NATIVE, ForwardPath
from lab.engine.models import wrap_model
from lab.params import build_params
from lab.tools import cli, doctor
from lab.trace import TokenEmitted, Trace, from_json, to_json
from strategies import get_strategy
from tests.tiny import ByteTokenizer, tiny_llama, tiny_loaded_model


def bf16_model():
    return wrap_model(tiny_llama(1).to(torch.bfloat16), ByteTokenizer(), spec="tiny-bf16")


@pytest.fixture
def op(monkeypatch) -> dict:
    """The op's build as a switch the test flips (`built`); forwards never reach the real op."""
    state = {"built": False}
    monkeypatch.setattr(native_forward, "available", lambda: state["built"])
    monkeypatch.setattr(native_forward, "build", lambda verbose=False: state["built"])
    monkeypatch.setattr(native_forward, "build_state", lambda: "built" if state["built"] else "building")
    return state


@pytest.fixture
def native_calls(monkeypatch) -> list[bool]:
    """The `native` flag of every lean forward (then run on the Python loop, so no op is needed)."""
    calls: list[bool] = []
    real = runtime.lean_forward

    def spy(*args, native: bool = True, **kwargs):
        calls.append(native)
        return real(*args, native=False, **kwargs)

    monkeypatch.setattr(runtime, "lean_forward", spy)
    return calls


def test_choose_names_the_path_and_why(monkeypatch, op) -> None:
    fp32 = tiny_loaded_model(seed=1)
    path = forward_path.choose(fp32)
    assert path.name == LEAN and "bf16 / fp16 only" in path.reason
    assert path.row_invariant == (not invariance.BLAS_NOT_STRICT)  # float32: where MKL's strict mode is on
    bf16 = bf16_model()
    assert forward_path.choose(bf16).name == LEAN and "building" in forward_path.choose(bf16).reason
    op["built"] = True
    assert forward_path.choose(bf16) == ForwardPath(NATIVE, forward_path.choose(bf16).reason, True)
    monkeypatch.setenv(native_forward.SWITCH, "0")
    assert forward_path.choose(bf16).name == LEAN and native_forward.SWITCH in forward_path.choose(bf16).reason
    monkeypatch.setenv(lean_forward.SWITCH, "0")
    assert forward_path.choose(bf16).name == MODEL and lean_forward.SWITCH in forward_path.choose(bf16).reason


def _greedy(loaded, n: int = 6):
    params = build_params(get_strategy("greedy").Params, {"max_new_tokens": n})
    return get_strategy("greedy").run(loaded, [5, 6, 7], params, torch.Generator().manual_seed(0))


def test_a_build_finishing_mid_run_does_not_switch_the_run(op, native_calls) -> None:
    loaded = bf16_model()
    events = forward_path.pinned(_greedy(loaded))
    first = next(events)  # the prefill ran: the run's path is decided (the op is still building)
    op["built"] = True  # the background build finishes
    tokens = sum(isinstance(e, TokenEmitted) for e in [first, *events])
    assert tokens > 1 and native_calls == [False] * tokens  # one forward per token, all on the lean loop
    assert forward_path.choose(loaded).native  # the next run takes the op
    list(forward_path.pinned(_greedy(loaded)))
    assert len(native_calls) == 2 * tokens and all(native_calls[tokens:])


def test_without_a_pinned_run_each_forward_decides(op, native_calls) -> None:
    """The control of the test above: the same flip outside `pinned` switches paths mid-run."""
    events = _greedy(bf16_model())
    next(events)
    op["built"] = True
    list(events)
    assert native_calls[0] is False and native_calls[-1] is True


def test_pinned_closes_the_stream_and_keeps_no_context(op) -> None:
    closed = []

    def stream():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    events = forward_path.pinned(stream())
    assert next(events) == 1
    assert forward_path._RUN.get() is None  # not set between events
    events.close()
    assert closed == [True]


def test_the_run_path_is_in_the_trace_and_old_traces_load(op) -> None:
    loaded = bf16_model()
    request = validate_request("greedy", "hello", {"max_new_tokens": 4})
    trace = new_trace(request, loaded)
    assert trace.forward_path == forward_path.choose(loaded).as_dict() and trace.forward_path["name"] == LEAN
    assert path_of(trace) == forward_path.choose(loaded)
    again = from_json(to_json(trace))
    assert again.forward_path == trace.forward_path
    old = json.loads(to_json(Trace("greedy", "m", "p", {})))
    assert "forward_path" not in old and from_json(json.dumps(old)).forward_path is None
    old["forward_path"] = "native"
    with pytest.raises(ValueError, match="forward_path"):
        from_json(json.dumps(old))


def test_doctor_reports_the_path_and_agreement(op) -> None:
    op["built"] = False
    data = doctor.report(tiny_loaded_model(seed=2))
    assert data["forward_path"]["name"] == LEAN and "bf16 / fp16 only" in data["forward_path"]["reason"]
    assert [(a["path"], a["bit_equal"], a["forwards"]) for a in data["agreement"]] == [(LEAN, True, 3)]
    text = doctor.format_report(data)
    assert "forward path: lean (" in text and "lean: bit-equal over 3 forwards" in text
    assert "cpu flags: avx2" in text and "native op: not built" in text


def test_doctor_flags_paths_that_differ(monkeypatch, capsys, op) -> None:
    loaded = tiny_loaded_model(seed=2)
    monkeypatch.setattr(doctor, "load_model", lambda *args: loaded)
    assert cli.main(["doctor", "--device", "cpu"]) == 0
    assert "lean: bit-equal" in capsys.readouterr().out
    real = runtime.lean_forward

    def off_by_a_bit(*args, **kwargs):
        logits, hidden = real(*args, **kwargs)
        return logits + 1e-3, hidden

    monkeypatch.setattr(runtime, "lean_forward", off_by_a_bit)
    assert cli.main(["doctor", "--json"]) == doctor.EXIT_DIFFER
    data = json.loads(capsys.readouterr().out)
    assert data["agreement"][0]["bit_equal"] is False and data["agreement"][0]["max_abs_diff"] > 0


@pytest.mark.skipif(not native_forward.build(), reason="no C++ compiler: the op is not built here")
def test_doctor_compares_the_op_on_a_bf16_model() -> None:
    data = doctor.report(bf16_model())
    assert data["forward_path"]["name"] == NATIVE
    assert [(a["path"], a["bit_equal"]) for a in data["agreement"]] == [(LEAN, True), (NATIVE, True)]
