"""The classroom pieces without a model: the shared model lane (lab.app.shared_runs), paced release (lab.app.pacing),
token stepping (lab.app.replay), branch points and branch traces (lab.app.branching, Trace.branch), the thread policy
(lab.engine.threads) and the tree of runs (visualizers.branches)."""

from __future__ import annotations

import threading
import time

import pytest

from lab.app import shared_runs
from lab.app.branching import BranchError, branch_point, branch_record
from lab.app.pacing import STEP, PaceControl, Pacer, token_cuts
from lab.app.replay import position_status, token_count, trace_at, trace_at_token
from lab.app.runner import stopped_trace
from lab.app.shared_runs import QueueFull, RunHub, Waiting
from lab.engine import threads
from lab.trace import RunFinished, TokenEmitted, Trace, from_json, to_json
from visualizers.branches import run_tree_html


def token(step: int, text: str = "a", token_id: int = 1) -> TokenEmitted:
    return TokenEmitted(step, token_id, text, "target", 0.0, [token_id, 7, 8], [text, "x", "y"], [0.6, 0.3, 0.1])


def slow_events(n: int, gate: threading.Event | None = None, delay: float = 0.0, opened: list | None = None):
    def open_events():
        if opened is not None:
            opened.append(1)

        def gen():
            if gate is not None:
                gate.wait(10)
            for i in range(n):
                time.sleep(delay)
                yield token(i)
            yield RunFinished(n, "max_new_tokens", 0.1, 0, n)

        return gen()

    return open_events


def collect(hub: RunHub, job) -> tuple[list, list]:
    events, places = [], []
    for item in hub.follow(job, poll_s=0.02):
        if isinstance(item, Waiting):
            places.append(item)
        else:
            events.extend(item)
    return events, places


def test_identical_requests_share_one_run_and_later_ones_come_from_the_cache():
    hub = RunHub(max_waiting=4)
    opened: list = []
    gate = threading.Event()
    jobs = [hub.submit("same", slow_events(5, gate, opened=opened), 5) for _ in range(3)]
    results: list = [None] * 3
    workers = [threading.Thread(target=lambda i=i: results.__setitem__(i, collect(hub, jobs[i]))) for i in range(3)]
    for w in workers:
        w.start()
    gate.set()
    for w in workers:
        w.join(10)
    assert len(opened) == 1 and hub.runs_started == 1
    assert all(len(r[0]) == 6 for r in results) and results[0][0] == results[1][0] == results[2][0]
    cached = hub.submit("same", slow_events(5, opened=opened), 5)
    assert cached.done and collect(hub, cached)[0] == results[0][0] and len(opened) == 1
    assert hub.status()["shared_answers"] == 3


def test_waiting_askers_see_their_place_and_a_wait_and_a_full_line_is_refused():
    hub = RunHub(max_waiting=2)
    gate = threading.Event()
    first = hub.submit("a", slow_events(3, gate), 3)
    time.sleep(0.1)  # the worker takes "a"
    second = hub.submit("b", slow_events(3), 30)
    third = hub.submit("c", slow_events(3), 30)
    with pytest.raises(QueueFull, match=r"Queue is full: 2 runs are waiting .*#3"):
        hub.submit("d", slow_events(3), 3)
    hub.submit("b", slow_events(3), 30)  # joining a waiting run is always allowed
    places = {}
    follow = hub.follow(third, poll_s=0.02)
    places["third"] = next(follow)
    follow.close()  # the third asker leaves: its run leaves the line
    assert isinstance(places["third"], Waiting) and places["third"].position == 2 and places["third"].eta_s > 0
    gate.set()
    assert len(collect(hub, first)[0]) == 4 and len(collect(hub, second)[0]) == 4
    assert hub.runs_started == 2  # "c" never ran


def test_a_run_everyone_left_is_cancelled_and_errors_reach_every_asker():
    hub = RunHub(max_waiting=2)
    job = hub.submit("long", slow_events(1000, delay=0.01), 1000)
    follow = hub.follow(job, poll_s=0.02)
    while not any(isinstance(item, list) and item for item in [next(follow)]):
        pass
    follow.close()
    deadline = time.monotonic() + 5
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.done and job.cancelled.is_set() and len(job.events) < 1000

    def broken():
        raise ValueError("no such model")

    failing = hub.submit("bad", broken, 4)
    with pytest.raises(ValueError, match="no such model"):
        collect(hub, failing)
    assert hub.submit("bad", broken, 4) is not failing  # failures are not cached


def test_a_run_whose_askers_stopped_reading_is_cancelled(monkeypatch):
    monkeypatch.setattr(shared_runs, "STALE_S", 0.3)
    hub = RunHub(max_waiting=2)
    job = hub.submit("abandoned", slow_events(1000, delay=0.01), 1000)
    follow = hub.follow(job, poll_s=0.02)
    next(follow)  # read once, then never again and never closed (a cancelled handler)
    deadline = time.monotonic() + 10
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.done and job.cancelled.is_set() and len(job.events) < 1000


def test_pacer_releases_tokens_at_the_pace_and_steps_on_click():
    events = [token(i) for i in range(10)]
    control = PaceControl("1 token/s")
    pacer = Pacer(control, start=0.0)
    shown = [sum(isinstance(e, TokenEmitted) for e in events[: pacer.visible(events, t)]) for t in (0.0, 0.5, 1.0, 3.2)]
    assert shown == [1, 1, 2, 4]
    control.set_pace("real time")
    assert pacer.visible(events, 3.3) == len(events)
    step = PaceControl(STEP)
    stepper = Pacer(step, start=0.0)
    assert stepper.visible(events, 100.0) == 0
    step.step()
    step.step()
    assert stepper.visible(events, 100.0) == token_cuts(events)[2] and not stepper.caught_up(events)


def test_token_stepping_positions_and_branch_traces_round_trip():
    trace = Trace("greedy", "m", "p", {"max_new_tokens": 3}, [token(0, "A", 1), token(1, "B", 2), token(2, "C", 3)])
    assert token_count(trace) == 3 and trace_at_token(trace, 1).text == "A" and trace_at_token(trace, 9) is trace
    point = branch_point(trace, "run-1", 1, 7)
    assert point.prefix_ids == (1,) and point.forced_text == "x" and point.replaced_text == "B"
    with pytest.raises(BranchError):
        branch_point(trace, "run-1", 1, 12345)
    with pytest.raises(BranchError):
        branch_point(trace, "run-1", 5, 7)
    assert branch_point(trace, "run-1", 0, None, typed=" hello").forced_id is None
    branched = Trace("greedy", "m", "p", {}, [token(0, "x", 7)], branch=branch_record(point))
    loaded = from_json(to_json(branched))
    assert loaded.branch["parent_run"] == "run-1" and loaded.branch["prefix_ids"] == [1]
    assert from_json(to_json(trace)).branch is None  # a trace without the field (all older ones) loads


def test_stepped_and_replayed_prefixes_keep_what_the_trace_records():
    events = [token(0, "A", 1), token(1, "B", 2), token(2, "C", 3)]
    branch = {"parent_run": "run-1", "at_token": 1}
    trace = Trace("greedy", "m", "p", {}, events, dtype="bfloat16", precision="int4", branch=branch)
    for prefix in (trace_at_token(trace, 1), trace_at(trace, 1)):
        assert (prefix.dtype, prefix.precision, prefix.branch) == ("bfloat16", "int4", branch)
        assert len(prefix.events) < len(events)


def test_thread_policy_counts_free_cpus():
    assert threads.usable_cpus() >= 1
    assert threads.intra_op_threads(1, cpus=2, busy=0.0) == 2
    assert threads.intra_op_threads(1, cpus=2, busy=0.7) == 1
    assert threads.intra_op_threads(1, cpus=2, busy=2.0) == 1
    assert threads.intra_op_threads(2, cpus=8, busy=0.0) == 4
    assert threads.busy_cpus(0.05) >= 0.0


def test_run_tree_lists_branches_under_their_parent():
    nodes = [
        {"id": "a", "parent": None, "label": "The sky <is> blue"},
        {"id": "b", "parent": "a", "label": "since ...", "at_token": 4, "replaced": " because", "forced": " since"},
    ]
    html = run_tree_html(nodes)
    assert "original run" in html and "&lt;is&gt;" in html and "token 5" in html and "␣since" in html
    assert html.index("original run") < html.index("branch at")


def test_trace_files_written_at_once_by_many_handlers_all_land(tmp_path, monkeypatch):
    """A shared run's askers finish together and each saves the trace while the folder is full: pruning must not
    fail on a file another handler removed."""
    import threading

    from ui import common

    monkeypatch.setattr(common, "TRACE_DIR", tmp_path)
    monkeypatch.setattr(common, "MAX_TRACE_FILES", 5)
    for i in range(5):
        (tmp_path / f"old-{i}.json").write_text("{}")
    paths, errors = [], []

    def save() -> None:
        try:
            paths.append(common.write_trace_file("{}"))
        except Exception as error:  # noqa: BLE001 - the test reports any failure
            errors.append(error)

    workers = [threading.Thread(target=save) for _ in range(20)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors and len(paths) == 20
    assert len(list(tmp_path.glob("*.json"))) <= 5


def test_a_stopped_run_is_closed_as_a_cancelled_partial_run():
    """Stop (lab.app.runner.stopped_trace): the partial run gets a RunFinished("cancelled") and survives JSON."""
    control = PaceControl()
    control.request_stop()
    assert control.stop_requested
    trace = Trace("greedy", "m", "p", {}, [token(0, "a"), token(1, "b")])
    stopped = stopped_trace(trace)
    assert [e.stop_reason for e in stopped.events if isinstance(e, RunFinished)] == ["cancelled"]
    assert stopped.text == "ab" and len(trace.events) == 2  # the live trace is left alone
    assert from_json(to_json(stopped)).events[-1].stop_reason == "cancelled"
    assert stopped_trace(stopped) is stopped  # a run that finished is not closed twice


def test_the_position_status_says_which_token_is_shown_until_the_end():
    trace = Trace("greedy", "m", "p", {}, [token(0), token(1), RunFinished(2, "eos", 0.1, 0, 2)])
    assert position_status(trace, trace_at_token(trace, 1)) == "token 1 of 2 shown"
    assert position_status(trace, trace_at_token(trace, 2)) == ""  # the end: the run's own stop reason
    assert position_status(trace, trace_at_token(trace, 2), "stopped by you") == "stopped by you"


def test_a_runs_pace_control_is_not_live_once_its_final_update_goes_out(monkeypatch):
    """◀ / ▶ step through a finished run unless its session's control is live; Gradio runs the run handler's
    cleanup only when it asks the generator for the next item, after the browser already shows the final update, so
    the Run tab's stream clears `live` before it yields that update (a press in between was lost: the likely cause
    of one timeout of tests/e2e's keyboard test, not reproduced)."""
    from lab.engine.models import EMBEDDED_MODEL
    from ui import run_tab

    events = [token(0, "a"), token(1, "b"), RunFinished(2, "max_new_tokens", 0.1, 0, 2)]
    trace = Trace("greedy", EMBEDDED_MODEL, "a prompt", {"max_new_tokens": 2}, events)
    control = PaceControl(live=True)
    seen_live = []

    def stream(request, deadline, point=None, control=None):
        yield trace, False, "running", trace
        seen_live.append(control.live)
        yield trace, True, "done", trace

    monkeypatch.setattr(run_tab, "stream_trace", stream)
    updates = run_tab.stream_outputs("greedy", "a prompt", {"max_new_tokens": 2}, False, 0, EMBEDDED_MODEL, "cpu",
                                     "auto", control=control)  # fmt: skip
    next(updates)  # loading
    next(updates)  # a streamed render: still live
    final = next(updates)  # not resumed after this: the state Gradio is in while the browser shows it
    assert seen_live == [True] and control.live is False
    assert final[-1]["request"].strategy.name == "greedy" and final[-1]["trace"] is trace
