"""The Replay tab: a trace file (uploaded, a shipped example, or a run of this session's history) replayed step
by step with every view of its strategy (play / pause / slider), without loading a model. Loading goes through
`lab.app.replay.load_trace_file` (size cap, UTF-8, schema validation); a bad file gets a clear message.
"""

from __future__ import annotations

import gradio as gr

from lab.app import history, replay
from lab.trace import Trace, TraceError
from ui.common import (
    LIGHT,
    REPLAY_TICK_S,
    STATE_TTL_S,
    VIEW_COUNT,
    view_updates,
)
from ui.inspector import build_inspector, wire_inspector
from ui.layout import PRESENT_JS, build_views, step_buttons, view_list
from visualizers import display_token


def describe(trace: Trace, source: str) -> str:
    frames = replay.frame_count(trace)
    prompt = trace.prompt if len(trace.prompt) <= 120 else trace.prompt[:120] + "…"
    return (
        f"**{source}**: strategy `{trace.strategy}`, model `{trace.model}`, {len(trace.events)} events in "
        f"{frames} steps.  \n*Prompt:* {prompt}" + branch_note(trace)
    )


def branch_note(trace: Trace) -> str:
    """Where a branch trace left its parent run (an optional trace field; older traces have none)."""
    branch = trace.branch or {}
    if not branch:
        return ""
    at = branch.get("at_token")
    replaced, forced = (
        display_token(str(branch.get("replaced_text", ""))),
        display_token(str(branch.get("forced_text", ""))),
    )
    return f"  \n*Branched* at token {at + 1 if isinstance(at, int) else '?'} of its parent run: {replaced} → {forced}"


def frame_outputs(trace: Trace, frame: int) -> list:
    """Every view at replay position `frame` (the stats say how far the replay is until its end)."""
    shown = replay.trace_at(trace, frame)
    return view_updates(shown, replay.position_status(trace, shown))


def loaded_outputs(trace: Trace, source: str) -> list:
    """[status, slider, timer, views..., state] after loading a trace (shown whole; Play starts from step 0)."""
    last = replay.frame_count(trace)
    slider = gr.Slider(minimum=0, maximum=max(last, 1), value=last, step=1, interactive=True)
    return [describe(trace, source), slider, gr.Timer(active=False), *frame_outputs(trace, last), {"trace": trace}]


def load_or_explain(path: str | None, source: str) -> list:
    try:
        trace = replay.load_trace_file(path)
    except TraceError as error:
        raise gr.Error(f"Cannot replay this file: {error}", title="Not a valid trace") from None
    return loaded_outputs(trace, source)


def on_upload(path: str | None) -> list:
    return load_or_explain(path, "Uploaded trace")


def on_example(path: str | None) -> list:
    allowed = {p for _, p in replay.example_traces()}
    if path not in allowed:  # only the shipped files, whatever the client sends
        raise gr.Error("Unknown example trace.")
    return load_or_explain(path, "Example trace")


def on_history(records: list[dict] | None, run_id) -> list:
    record = history.find_run(records, run_id)
    if record is None:
        raise gr.Error("Pick a run of this session first.")
    return load_or_explain(record["path"], f"Run #{record['id']} of this session")


def on_seek(value: dict | None, frame: float) -> list:
    if not value:
        return [gr.skip()] * VIEW_COUNT
    return frame_outputs(value["trace"], int(frame or 0))


def on_step(value: dict | None, frame: float, delta: int) -> list:
    """One step back or forward (the ◀ / ▶ buttons and the arrow keys)."""
    if not value:
        return [gr.skip()] * (VIEW_COUNT + 1)
    target = max(0, min(int(frame or 0) + delta, replay.frame_count(value["trace"])))
    return [target, *frame_outputs(value["trace"], target)]


def on_play(value: dict | None, frame: float) -> list:
    """Start the timer; from step 0 when the replay is at its end."""
    if not value:
        raise gr.Error("Load a trace first (upload one, pick an example or a run of this session).")
    start = 0 if int(frame or 0) >= replay.frame_count(value["trace"]) else int(frame or 0)
    return [gr.Timer(active=True), start]


def on_tick(value: dict | None, frame: float) -> list:
    """Advance one step and render it; stop the timer at the end. It never switches the timer on: a tick that
    runs while Pause is pressed would otherwise restart playback."""
    if not value:
        return [gr.Timer(active=False), gr.skip(), *[gr.skip()] * VIEW_COUNT]
    last = replay.frame_count(value["trace"])
    nxt = min(int(frame or 0) + 1, last)
    timer = gr.Timer(active=False) if nxt >= last else gr.skip()
    return [timer, nxt, *frame_outputs(value["trace"], nxt)]


def build_replay_tab() -> dict:
    """Sources (upload, examples, history), transport controls, the views and an inspector."""
    with gr.Row():
        upload = gr.File(label="Upload a trace (.json)", file_types=[".json"], type="filepath", elem_id="trace-upload")
        with gr.Column():
            example = gr.Dropdown(
                replay.example_traces(), value=None, label="…or an example trace", elem_id="replay-example"
            )
            records = gr.Dropdown([], value=None, label="…or a run of this session", elem_id="history")
            open_run = gr.Button("Open run", elem_id="history-open")
    status = gr.Markdown("Load a trace to replay it step by step.", elem_id="replay-status")
    with gr.Row():
        play = gr.Button("▶ Play", elem_id="replay-play", scale=0, min_width=90)
        pause = gr.Button("Pause", elem_id="replay-pause", scale=0, min_width=90)  # no ⏸: many fonts lack it
        back, nxt = step_buttons("replay-")
        slider = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="replay-slider")
        present = gr.Button("Presentation mode", elem_id="replay-present-button", scale=0, min_width=170)
    views = build_views("replay-")
    inspector = build_inspector("replay-")
    state = gr.State(None, time_to_live=STATE_TTL_S)
    records_state = gr.State([], time_to_live=STATE_TTL_S)
    timer = gr.Timer(REPLAY_TICK_S, active=False)
    loaded = [status, slider, timer, *view_list(views), state]
    upload.upload(on_upload, [upload], loaded, **LIGHT)
    example.input(on_example, [example], loaded, **LIGHT)
    open_run.click(on_history, [records_state, records], loaded, **LIGHT)
    # a drag (on release) and a number typed into the slider's box both move the views
    seek = {**LIGHT, "trigger_mode": "always_last"}
    gr.on([slider.release, slider.input], on_seek, [state, slider], view_list(views), **seek)
    steps = {**LIGHT, "concurrency_id": "replay-step", "concurrency_limit": 1}  # presses in order
    back.click(lambda v, f: on_step(v, f, -1), [state, slider], [slider, *view_list(views)], **steps)
    nxt.click(lambda v, f: on_step(v, f, 1), [state, slider], [slider, *view_list(views)], **steps)
    present.click(None, None, None, js=PRESENT_JS)
    play.click(on_play, [state, slider], [timer, slider], **LIGHT)
    pause.click(lambda: gr.Timer(active=False), None, [timer], **LIGHT)
    timer.tick(on_tick, [state, slider], [timer, slider, *view_list(views)], **LIGHT)
    wire_inspector(inspector, state, [(views["tokens"], lambda value: value["trace"] if value else None)])
    return {"records": records, "records_state": records_state}


def record_run(run_state: dict | None, records: list[dict] | None) -> list:
    """After a Run finished: add it to the session's history (once) and refresh the history dropdown."""
    if not run_state:
        return [gr.skip(), gr.skip()]
    updated = history.add_run(records, run_state["trace"], run_state["path"], run_state["status"], run_state["id"])
    return [updated, gr.Dropdown(choices=history.history_choices(updated), value=updated[0]["id"])]
