"""The token inspector shared by the Run, Compare and Replay tabs: click a token of a token view and see that token's
own distribution (the target's p at its position and the draft's q where one exists, from
`visualizers.token_detail`, the source of the tooltip and of "Branch from here" too), its table and, for strategies
with a round view, the figure of its round; the inspector then scrolls into view. Gradio UI code only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gradio as gr

from lab.trace import TokenEmitted, Trace, TraceError, from_json
from ui.common import LIGHT
from visualizers import empty_figure, inspect_step, strategy_token_view, strategy_view
from visualizers.inspect import step_alternatives_figure
from visualizers.token_detail import token_detail, token_figure, token_rows

ALTERNATIVE_HEADERS = ["rank", "token", "p", "draft q"]


def first_token_of_step(trace: Trace, step: int) -> int:
    """The index of the first token emitted at `step` (0 when none is)."""
    tokens = [e for e in trace.events if isinstance(e, TokenEmitted)]
    return next((i for i, e in enumerate(tokens) if e.step == step), 0)


def inspect_figure(trace: Trace | None, index: int, gamma: float) -> list:
    """[token figure, round figure, gamma slider, alternatives rows] of the index-th token, re-rendered from the
    trace (no model): the token's own distribution (visualizers.token_detail, the source of the tooltip and the
    Branch list too) and, for strategies with a round view, the figure of its step."""
    if trace is None:
        empty = empty_figure("Inspect a token", "Run a strategy first")
        return [empty, gr.Plot(visible=False), gr.skip(), []]
    detail = token_detail(trace.events, index)
    view = strategy_view(trace.strategy)
    own_round_view = view.inspect is not step_alternatives_figure
    step = detail.event.step if detail else 0
    round_figure = inspect_step(trace.strategy, trace.events, step, gamma=gamma) if own_round_view else None
    return [
        token_figure(trace.events, index),
        gr.Plot(value=round_figure, visible=own_round_view),
        gr.Slider(visible="gamma" in view.knobs),
        token_rows(detail),
    ]


def inspect_trace(trace_json: str, step: float, gamma: float):
    """Re-render one step of a trace given as JSON: (figure, gamma slider)."""
    if not trace_json:
        return empty_figure("Inspect a step", "Run a strategy first"), gr.skip()
    try:
        trace = from_json(trace_json)
    except TraceError as error:
        raise gr.Error(f"Cannot read the trace: {error}") from None
    figure = inspect_step(trace.strategy, trace.events, int(step or 0), gamma=gamma)
    return figure, gr.Slider(visible="gamma" in strategy_view(trace.strategy).knobs)


def clicked_step(evt: gr.EventData) -> int | None:
    """The step sent by a token view's click (None for a click outside a token or a malformed payload)."""
    return _clicked(evt, "step")


def clicked_index(evt: gr.EventData) -> int | None:
    """The token index (0 = the first emitted token) sent by a token view's click, or None."""
    return _clicked(evt, "index")


def _clicked(evt: gr.EventData, key: str) -> int | None:
    data = getattr(evt, "_data", None)
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if 0 <= value < 10_000_000 else None


# After a token click: bring the inspector into view (it sits under the figures), keeping its top visible.
SCROLL_TO_INSPECTOR_JS = """
() => { const el = document.getElementById('{prefix}inspect-accordion');
        if (el) el.scrollIntoView({behavior: 'smooth', block: 'start'}); }
"""


def build_inspector(prefix: str, open_: bool = False) -> dict:
    """Token inspector: the clicked token's number and step, the strategy's knob (CFG's gamma), the token's own
    distribution (target p, draft q where one exists) beside its table, and the strategy's figure of the round."""
    with gr.Accordion(
        "Inspect a token (click one; re-rendered from the trace, no model run)",
        open=open_,
        elem_id=f"{prefix}inspect-accordion",
    ) as accordion:
        with gr.Row():
            token = gr.Number(value=1, precision=0, minimum=1, label="token #", elem_id=f"{prefix}inspect-token")
            step = gr.Number(value=0, precision=0, minimum=0, label="step", elem_id=f"{prefix}inspect-step")
            gamma = gr.Slider(
                0.0, 5.0, value=1.5, step=0.1, label="gamma", visible=False, elem_id=f"{prefix}inspect-gamma"
            )
        with gr.Row(equal_height=False):
            token_plot = gr.Plot(label="This token's distribution", elem_id=f"{prefix}inspect-token-plot")
            table = gr.Dataframe(
                headers=ALTERNATIVE_HEADERS, label="Top-k alternatives", elem_id=f"{prefix}alternatives"
            )
        plot = gr.Plot(label="Its round (full width)", visible=False, elem_id=f"{prefix}inspect-plot")
    return {
        "accordion": accordion, "token": token, "step": step, "gamma": gamma, "token_plot": token_plot,
        "plot": plot, "table": table, "prefix": prefix,
    }  # fmt: skip


def wire_inspector(inspector: dict, state: gr.State, sources: list[tuple[gr.HTML, Callable]]) -> None:
    """Clicking a token of any source's token view (or editing the token number, step or gamma) re-renders that
    token from the trace `get_trace(state value)` of the source clicked last, then scrolls the inspector into
    view. sources: (token view, get_trace) pairs."""
    which = gr.State(0)
    outputs = [inspector["token_plot"], inspector["plot"], inspector["gamma"], inspector["table"]]
    numbers = [inspector["token"], inspector["step"]]
    scroll = SCROLL_TO_INSPECTOR_JS.replace("{prefix}", inspector["prefix"])
    for index, (tokens, get_trace) in enumerate(sources):

        def on_click(value, gamma: float, evt: gr.EventData, _get=get_trace, _index=index):
            trace = _get(value)
            position, step = clicked_index(evt), clicked_step(evt)
            if trace is None or position is None or step is None:
                return [gr.skip()] * 9
            view = strategy_token_view(trace.strategy, trace.events, step)
            opened = gr.Accordion(open=True)
            return [opened, position + 1, step, view, *inspect_figure(trace, position, gamma), _index]

        click_outputs = [inspector["accordion"], *numbers, tokens, *outputs, which]
        tokens.click(on_click, [state, inspector["gamma"]], click_outputs, **LIGHT).then(None, js=scroll)

    def at_token(value, index: int, number: float, gamma: float):
        get_trace = sources[index][1] if 0 <= index < len(sources) else sources[0][1]
        trace = get_trace(value)
        position = max(0, int(number or 1) - 1)
        detail = token_detail(trace.events, position) if trace else None
        return [detail.event.step if detail else gr.skip(), *inspect_figure(trace, position, gamma)]

    def at_step(value, index: int, step: float, gamma: float):
        get_trace = sources[index][1] if 0 <= index < len(sources) else sources[0][1]
        trace = get_trace(value)
        position = first_token_of_step(trace, int(step or 0)) if trace else 0
        return [position + 1, *inspect_figure(trace, position, gamma)]

    inputs = [state, which]
    triggers = [inspector["token"].submit, inspector["gamma"].release]
    gr.on(triggers, at_token, [*inputs, inspector["token"], inspector["gamma"]], [inspector["step"], *outputs], **LIGHT)
    at_step_inputs = [*inputs, inspector["step"], inspector["gamma"]]
    inspector["step"].submit(at_step, at_step_inputs, [inspector["token"], *outputs], **LIGHT)
