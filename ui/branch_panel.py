"""The Run tab's "Branch from here" panel: click a token, pick one of its alternatives (or type one), and continue the
same strategy from that prefix; the branch streams beside the original, and a small tree lists the runs.

Gradio UI code only: the branch point and its events come from `lab.app.branching`, the model work from the shared lane
(`ui.common.stream_trace`), the tree from `visualizers.branches`.
"""

from __future__ import annotations

import time
import uuid

import gradio as gr

from lab.app.branching import BranchError, branch_point, tokens_of
from lab.trace import to_json
from ui.common import (
    LIGHT,
    MAX_RUN_SECONDS,
    RUN_QUEUE,
    STATE_TTL_S,
    start_pacing,
    stats_line,
    stream_trace,
    write_trace_file,
)
from ui.inspector import clicked_index, clicked_step
from ui.layout import TOKEN_CLICK_JS
from visualizers import display_token, strategy_token_view
from visualizers.branches import run_tree_html
from visualizers.token_detail import ranked

HINT = "Click a token of the run above, pick an alternative (or type one) and press **Branch from here**."


def build_branch_panel() -> dict:
    with gr.Accordion(
        "Branch from here: what if the model had picked another token?", open=True, elem_classes=["dl-hide-present"]
    ) as accordion:
        where = gr.Markdown(HINT, elem_id="branch-where")
        with gr.Row(equal_height=True):
            choice = gr.Dropdown([], value=None, label="continue with", elem_id="branch-choice", scale=2)
            typed = gr.Textbox(label="…or type a token", max_lines=1, elem_id="branch-typed", scale=2)
            start = gr.Button("Branch from here", variant="primary", elem_id="branch-button", scale=1)
        with gr.Row(equal_height=False):
            with gr.Column(min_width=280):
                gr.Markdown("**Original**")
                original = gr.HTML(elem_id="branch-original")
            with gr.Column(min_width=280):
                title = gr.Markdown("**Branch**", elem_id="branch-title")
                tokens = gr.HTML(elem_id="branch-tokens", js_on_load=TOKEN_CLICK_JS)
                stats = gr.Markdown(elem_id="branch-stats")
        tree = gr.HTML(run_tree_html([]), elem_id="run-tree")
    return {
        "accordion": accordion,
        "where": where,
        "choice": choice,
        "typed": typed,
        "start": start,
        "original": original,
        "title": title,
        "tokens": tokens,
        "stats": stats,
        "tree": tree,
        "at": gr.State(None),
        "runs": gr.State([], time_to_live=STATE_TTL_S),
        "state": gr.State(None, time_to_live=STATE_TTL_S),
    }


def on_token(state: dict | None, evt: gr.EventData) -> list:
    """A click on a token of the run: offer that token's alternatives (second best preselected), from
    `visualizers.token_detail.ranked`, the source of the tooltip and the inspector too."""
    index = clicked_index(evt)
    tokens = tokens_of(state["trace"]) if state else []
    if clicked_step(evt) is None or index is None or not index < len(tokens):
        return [gr.skip()] * 3
    at = tokens[index]
    choices = [(f"{a.rank}. {display_token(a.text, escape=False)}  (p={a.p:.3f})", a.token_id) for a in ranked(at)]
    preferred = next((i for _, i in choices if i != at.token_id), None)
    where = f"Branch at token {index + 1} (step {at.step}): the run chose **{display_token(at.text)}**."
    return [where, gr.Dropdown(choices=choices, value=preferred), index]


def branch_run(request: gr.Request, state: dict | None, at, choice, typed: str, pace: str, runs: list | None):
    """Stream the branch: the forced token, then the same strategy (same parameters and seed) from that prefix."""
    if not state or "request" not in state:
        raise gr.Error("Run a strategy first, then click one of its tokens.")
    if at is None:
        raise gr.Error("Click a token of the run first.")
    try:
        point = branch_point(state["trace"], state["id"], int(at), None if typed else choice, typed)
    except BranchError as error:
        raise gr.Error(str(error)) from None
    original = strategy_token_view(state["trace"].strategy, state["trace"].events, point.at_step)
    title = f"**Branch**: {display_token(point.replaced_text)} → {display_token(point.forced_text)}"
    control = start_pacing(request, pace)
    try:
        deadline = time.monotonic() + MAX_RUN_SECONDS
        for shown, final, status, full in stream_trace(state["request"], deadline, point, control):
            view = strategy_token_view(shown.strategy, shown.events)
            if not final:
                yield [view, stats_line(shown, status), original, title, gr.skip(), gr.skip(), gr.skip()]
                continue
            path = write_trace_file(to_json(full), "branch")
            run_id = uuid.uuid4().hex
            nodes = _with_branch(runs, state, run_id, point, full.text)
            branch_state = {"id": run_id, "trace": full, "path": path, "status": status, "request": state["request"]}
            control.live = False  # before the final update goes out (ui.run_tab.stream_outputs says why)
            yield [view, stats_line(shown, status), original, title, run_tree_html(nodes), nodes, branch_state]
    finally:
        control.live = False


def _with_branch(runs: list | None, state: dict, run_id: str, point, text: str) -> list[dict]:
    nodes = list(runs or [])
    if not any(n["id"] == state["id"] for n in nodes):
        parent = (state["trace"].branch or {}).get("parent_run")
        nodes.append({"id": state["id"], "parent": parent, "label": state["trace"].text})
    forced = point.forced_text
    branch = {"at_token": point.at_token, "replaced": point.replaced_text, "forced": forced}
    nodes.append({"id": run_id, "parent": state["id"], "label": text, **branch})
    return nodes


def wire_branch_panel(panel: dict, state: gr.State, run_tokens: gr.HTML, pace: gr.Radio) -> None:
    run_tokens.click(on_token, [state], [panel["where"], panel["choice"], panel["at"]], **LIGHT)
    inputs = [state, panel["at"], panel["choice"], panel["typed"], pace, panel["runs"]]
    outputs = [panel["tokens"], panel["stats"], panel["original"], panel["title"], panel["tree"], panel["runs"]]
    panel["event"] = panel["start"].click(
        branch_run, inputs, [*outputs, panel["state"]], api_visibility="private", **RUN_QUEUE
    )
