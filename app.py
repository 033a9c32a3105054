"""Decoding Lab web app (Gradio): run, compare, replay, learn and measure decoding strategies.

UI only (docs/architecture.md section 9): inputs are validated by `lab.app.validation`, model work goes through
`lab.app.runner`, figures come from `visualizers`, and the tabs' logic lives in gradio-free modules (`lab.app.compare`,
`lab.app.replay`, `lab.app.learn`, `lab.tools.measure`, `lab.app.history`, `lab.app.presets`, `lab.app.controls`,
`lab.app.zerogpu`) and the tabs' layout in `ui/` (one module per tab, shared pieces in `ui/common.py`). Every tab is
built from the registries (`strategies.REGISTRY`, `visualizers.VIEWS`), so a new strategy appears everywhere.

Classroom: every model run (Run, Branch, Compare) goes through one model lane (`lab.app.shared_runs.RunHub`, one run
at a time; Measure takes its lock): a Run handler waits inside the lane and shows its place in line and an
estimated wait; identical requests (model, strategy, parameters, prompt, chat, seed, branch) share one run, and
recently finished ones are answered from their recorded events. At most DECODING_LAB_QUEUE_SIZE distinct runs
(default 32: a class of 30, the teacher and one spare) may wait; beyond that the user is told the queue is full
and for how long. Each run has a hard time limit (MAX_RUN_SECONDS). Before each run `lab.engine.threads.apply` picks the
intra-op threads from the CPUs free at that moment.
Light work (replay, inspect, learn, stepping, pace changes) runs in its own concurrency groups. Per-session data
lives in gr.State with a time to live; models are shared through the `lab.engine.models` cache (at most two loaded,
never one per session). Stop ends the session's live run as a result (the tokens shown so far, closed as a cancelled
run; the lane's generator is closed, which frees the KV cache). Renders are throttled to about 5 per second.
ZeroGPU (Hugging Face Spaces): `model_events` (load, encode, stream plain trace events) is wrapped with
`spaces.GPU` when SPACES_ZERO_GPU is set and `spaces` imports (`lab.app.zerogpu`); figures are built outside it.

`python app.py` serves at http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT override) and warms the
embedded model in the background. The stable API endpoint `/run` (gradio_client) takes
(model, strategy, prompt, chat, max_new_tokens, seed, params_json) and streams
(token_html, figure, stats, text, trace_json, trace_file, detail figures...); the final update carries every
output. `/compare` takes (strategies, prompt, seed, max_new_tokens, chat, model, device, dtype, precision) and
streams four columns of (title, token_html, stats, figure), then the diff HTML and the summary table.

Element ids (stable; the browser tests use them; the Run tab's weight precision is `precision`):
  tabs: tab-run, tab-compare, tab-replay, tab-learn, tab-measure
  page: dl-header
  run:  run-settings, model, strategy, preset, prompt, example-prompts, run-stop, run-button, stop-button,
        run-controls, chat, pace, step-back, step-next,
        present-button, stats, views, token-view, main-plot, detail-plot-{1..5}, text, trace-file,
        inspect-accordion, inspect-token, inspect-step, inspect-gamma, inspect-token-plot, inspect-plot, alternatives,
        branch-where, branch-choice, branch-typed, branch-button, branch-original, branch-title, branch-tokens,
        branch-stats, run-tree
  compare: compare-strategies, compare-prompt, compare-seed, compare-tokens-max, compare-run, compare-stop,
        compare-col-{0..3}, compare-title-{0..3}, compare-tokens-{0..3}, compare-stats-{0..3}, compare-plot-{0..3},
        compare-diff, compare-summary, compare-inspect-token-plot, compare-inspect-plot, compare-alternatives
  replay: trace-upload, replay-example, history, history-open, replay-status, replay-slider, replay-play,
        replay-pause, replay-step-back, replay-step-next, replay-present-button, replay-views, replay-stats,
        replay-token-view, replay-main-plot, replay-detail-plot-{1..5}, replay-text,
        replay-inspect-token-plot, replay-inspect-plot, replay-alternatives
  learn: learn-language, learn-strategy, learn-text
  measure: measure-strategies, measure-prompts, measure-tokens, measure-run, measure-table, measure-quality,
        measure-acceptance, measure-matrix, measure-file
Token views (token-view, replay-token-view, compare-tokens-i) are gr.HTML with a click listener: clicking a
token (a span with data-step and data-index) opens that token in the tab's inspector (its own distribution: the
target's p at its position and the draft's q where one exists, its table, and the strategy's figure of its round)
and, in the Run tab, offers its alternatives to "Branch from here". Layout (ui/layout.py): token view and main
figure side by side, details in an accordion, presentation mode (body.dl-present), left / right arrow keys click
the visible tab's ◀ / ▶ buttons.
"""

from __future__ import annotations

import os
import threading

import gradio as gr

from lab.engine.models import EMBEDDED_MODEL, ModelLoadError, load_model
from ui.common import HUB, LIGHT, MAX_UPLOAD, QUEUE_MAX_SIZE, stats_markdown
from ui.compare_tab import build_compare_tab
from ui.inspector import inspect_trace
from ui.layout import CSS, PAGE_JS
from ui.learn_tab import build_learn_tab
from ui.measure_tab import build_measure_tab
from ui.replay_tab import build_replay_tab, record_run
from ui.run_tab import parse_params_json, run_api, stream_outputs

__all__ = ["build_app", "inspect_trace", "main", "parse_params_json", "run_api", "stats_markdown", "stream_outputs"]


def build_app(queue_max_size: int = QUEUE_MAX_SIZE) -> gr.Blocks:
    """The whole UI; nothing is loaded until the first run. `queue_max_size`: waiting events the queue accepts."""
    from ui.run_tab import build_run_tab

    with gr.Blocks(title="Decoding Lab") as demo:
        gr.Markdown(
            "# Decoding Lab\nRun decoding strategies on a real model and watch what they do, token by token.",
            elem_id="dl-header",
        )
        with gr.Tabs():
            with gr.Tab("Run", id="run", elem_id="tab-run"):
                run = build_run_tab()
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                build_compare_tab(run)
            with gr.Tab("Replay", id="replay", elem_id="tab-replay"):
                replay = build_replay_tab()
            with gr.Tab("Learn", id="learn", elem_id="tab-learn"):
                language = build_learn_tab()
            with gr.Tab("Measure", id="measure", elem_id="tab-measure"):
                build_measure_tab(run, language)
        finished = [(event, run["state"]) for event in run["events"]]
        for event, state in [*finished, (run["branch"]["event"], run["branch"]["state"])]:
            event.then(
                record_run,
                [state, replay["records_state"]],
                [replay["records_state"], replay["records"]],
                **LIGHT,
            )
    # Gradio's own queue: room for every student's Run (they wait in the model lane, where they see their place)
    # and for light work on top
    HUB.max_waiting = queue_max_size
    demo.queue(max_size=2 * queue_max_size, default_concurrency_limit=1)
    return demo


def warm_embedded_model() -> None:
    """Load the embedded model in the background so the first run does not wait for it."""

    def load() -> None:
        try:
            load_model(EMBEDDED_MODEL)
        except ModelLoadError as error:
            print(f"[decoding-lab] could not preload the embedded model: {error}")

    threading.Thread(target=load, daemon=True, name="warm-model").start()


def main() -> None:
    demo = build_app()
    if os.environ.get("DECODING_LAB_NO_WARM") != "1":
        warm_embedded_model()
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        theme=gr.themes.Soft(),
        css=CSS,
        js=PAGE_JS,
        max_file_size=MAX_UPLOAD,
        max_threads=2 * QUEUE_MAX_SIZE + 40,  # waiting Run handlers hold a thread each
    )


if __name__ == "__main__":
    main()
