"""The Compare tab: the same prompt and seed through 2-4 strategies (their default parameters), streamed one
after another into side-by-side columns (token view, speed, acceptance and tau, main view), then a token diff
of each output against the first and a summary table (`lab.app.compare`). Clicking a token in any column opens
that run's step in the tab's inspector. The runs share one time budget of MAX_RUN_SECONDS. Stop ends the
comparison as a result, as the Run tab's does: the run in progress keeps what it streamed ("stopped by you"), the
runs after it are not started, and the diff and summary cover the runs there are.
"""

from __future__ import annotations

import time

import gradio as gr

from lab.app import compare
from lab.app.compare import MAX_COMPARED
from lab.app.pacing import REALTIME, PaceRegistry
from lab.trace import Trace
from strategies import REGISTRY
from ui.common import (
    LIGHT,
    MAX_RUN_SECONDS,
    MODEL_QUEUE,
    STATE_TTL_S,
    checked_request,
    session_pace,
    start_pacing,
    stats_line,
    strategy_choices,
    stream_trace,
    view_updates,
)
from ui.inspector import build_inspector, wire_inspector
from ui.layout import TOKEN_CLICK_JS
from visualizers import empty_figure
from visualizers.compare import diff_html

COLUMN_OUTPUTS = 4  # title, token view, stats, main plot
NUMERICS_NOTE = (
    "Lossless methods (the speculative family in greedy mode) reproduce greedy exactly in float32; in bfloat16 a "
    "multi-token verify forward can round a near-tie the other way, so a late difference can come from numerics."
)
DEFAULT_COMPARED = [name for name in ("greedy", "speculative", "sample") if name in REGISTRY][:3]


COLUMN_PLOT_PX = 240  # plot width of one of four columns on a 1400 px page
STOPS = PaceRegistry()  # per browser session: the Compare tab's own Stop (the Run tab's pace is not touched)


def _requests(names: list[str], prompt: str, seed, max_new_tokens, options: dict) -> list:
    names = list(dict.fromkeys(names or []))
    if not 2 <= len(names) <= MAX_COMPARED:
        raise gr.Error(f"Choose 2 to {MAX_COMPARED} different strategies to compare.")
    params = {"max_new_tokens": max_new_tokens}
    return [checked_request(name, prompt, params, seed=seed, **options) for name in names]


def _column(trace: Trace, status: str = "") -> list:
    tokens, main, _stats, _text, *_details = view_updates(trace, status, width_px=COLUMN_PLOT_PX)
    return [f"#### {trace.strategy}", tokens, stats_line(trace, status), main]


def _frame(index: int, column: list, count: int) -> list:
    """Outputs with column `index` updated and the others untouched."""
    updates = [gr.skip()] * (MAX_COMPARED * COLUMN_OUTPUTS)
    updates[index * COLUMN_OUTPUTS : (index + 1) * COLUMN_OUTPUTS] = column
    visible = [gr.Column(visible=i < count) for i in range(MAX_COMPARED)]
    return visible + updates + [gr.skip(), gr.skip(), gr.skip()]


def _final(traces: list[Trace], statuses: list[str]) -> list:
    columns = []
    for i in range(MAX_COMPARED):
        if i < len(traces):
            columns += _column(traces[i], statuses[i])
        else:
            columns += ["", "", "", empty_figure()]
    diffs = {t.strategy: compare.token_diff(traces[0], t) for t in traces[1:]}
    summary = compare.rows_markdown(compare.compare_rows(traces))
    visible = [gr.Column(visible=i < len(traces)) for i in range(MAX_COMPARED)]
    summary += f"\n\n*{NUMERICS_NOTE}*"
    return visible + columns + [diff_html(traces[0].strategy, diffs), summary, {"traces": traces}]


def compare_runs(
    request: gr.Request, names, prompt, seed, max_new_tokens, chat, model, device, dtype, precision="auto"
):
    """Stream each strategy in turn into its column, then the diff and the summary; Stop (`stop_compare`) ends the
    run in progress as a result and starts no more."""
    options = {"chat": chat, "model": model, "device": device, "dtype": dtype, "precision": precision}
    requests = _requests(names, prompt, seed, max_new_tokens, options)
    control = start_pacing(request, REALTIME, STOPS)
    deadline = time.monotonic() + MAX_RUN_SECONDS
    traces, statuses = [], []
    try:
        for index, run in enumerate(requests):
            if time.monotonic() > deadline or control.stop_requested:
                break
            for trace, final, status, _full in stream_trace(run, deadline, control=control):
                if final:
                    traces.append(trace)
                    statuses.append(status)
                yield _frame(index, _column(trace, status), len(requests))
        yield _final(traces, statuses)
    finally:
        control.live = False


def stop_compare(request: gr.Request) -> None:
    """The Compare tab's Stop: the comparison in progress ends with what it has (`compare_runs`)."""
    session_pace(request, STOPS).request_stop()


def build_compare_tab(settings: dict) -> None:
    """Compare controls, four columns, the diff and summary; uses the Run tab's model, device, dtype, precision and
    chat settings."""
    with gr.Row():
        names = gr.Dropdown(
            strategy_choices(),
            value=DEFAULT_COMPARED,
            multiselect=True,
            max_choices=MAX_COMPARED,
            label=f"Strategies (2-{MAX_COMPARED}, default parameters)",
            elem_id="compare-strategies",
        )
        seed = gr.Number(value=0, precision=0, minimum=0, label="seed", elem_id="compare-seed")
        budget = gr.Slider(1, 256, value=48, step=1, label="max_new_tokens", elem_id="compare-tokens-max")
    prompt = gr.Textbox(
        label="Prompt", lines=2, value="Why is the sky blue? Explain it simply.", elem_id="compare-prompt"
    )
    with gr.Row():
        run = gr.Button("Compare", variant="primary", elem_id="compare-run")
        stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
    columns, outputs = [], []
    with gr.Row(equal_height=False):
        for i in range(MAX_COMPARED):
            with gr.Column(visible=i < len(DEFAULT_COMPARED), min_width=260) as column:
                outputs += [
                    gr.Markdown(elem_id=f"compare-title-{i}"),
                    gr.HTML(elem_id=f"compare-tokens-{i}", js_on_load=TOKEN_CLICK_JS),
                    gr.Markdown(elem_id=f"compare-stats-{i}"),
                    gr.Plot(elem_id=f"compare-plot-{i}", label="Internals", show_label=False),
                ]
            columns.append(column)
    summary = gr.Markdown(elem_id="compare-summary")
    diff = gr.HTML(elem_id="compare-diff", label="Output diff")
    inspector = build_inspector("compare-")
    state = gr.State(None, time_to_live=STATE_TTL_S)
    inputs = [names, prompt, seed, budget, settings["chat"], settings["model"], settings["device"], settings["dtype"]]
    inputs.append(settings["precision"])
    run.click(compare_runs, inputs, columns + outputs + [diff, summary, state], api_name="compare", **MODEL_QUEUE)
    # Stop ends the comparison as a result (cancelling the event would put Gradio's red Error badge on every output)
    stop.click(stop_compare, None, None, **LIGHT)
    sources = [(outputs[i * COLUMN_OUTPUTS + 1], lambda value, _i=i: _trace(value, _i)) for i in range(MAX_COMPARED)]
    wire_inspector(inspector, state, sources)


def _trace(value, index: int) -> Trace | None:
    traces = (value or {}).get("traces", [])
    return traces[index] if index < len(traces) else None
