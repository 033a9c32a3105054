"""Decoding Lab web app (Gradio): pick a model and a strategy, run it, watch its internals stream live.

UI only (DESIGN.md section 9): inputs are validated by `lab.validation`, model work goes through
`lab.runner`, figures come from `visualizers`. Model work shares one queue (`concurrency_id="model"`, one at a
time, bounded queue) with a hard time limit per run; Stop cancels the running generator, whose `finally` frees
the KV cache. Renders are throttled to about 5 per second. No user data lives in module globals.

`python app.py` serves at http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT override) and warms the
embedded model in the background. The stable API endpoint `/run` (gradio_client) takes
(model, strategy, prompt, chat, max_new_tokens, seed, params_json) and streams
(token_html, figure, stats, text, trace_json, trace_file, detail figures...); the final update carries every
output.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import gradio as gr

from lab.models import EMBEDDED_MODEL, ModelLoadError, load_model
from lab.params import DecodeParams, InputError, param_specs
from lab.prompts import BUILTIN_PROMPTS
from lab.runner import new_trace, prepare, stream_run
from lab.trace import Trace, TraceError, from_json, summarize, to_json
from lab.validation import validate_request
from strategies import REGISTRY, by_family
from visualizers import empty_figure, inspect_step, strategy_figures, strategy_token_view, strategy_view

RENDER_INTERVAL_S = 0.2
MAX_RUN_SECONDS = 300
QUEUE_MAX_SIZE = 16
MAX_PARAMS_JSON_CHARS = 10_000
MODEL_CHOICES = [
    EMBEDDED_MODEL,
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct",
]
TRACE_DIR = Path(tempfile.gettempdir()) / "decoding-lab-traces"
MAX_TRACE_FILES = 200
COMMON_DEFAULTS = DecodeParams()
MAX_FIGURES = 4  # plot slots: a strategy's main view first, then its detail views


def strategy_choices() -> list[tuple[str, str]]:
    """Dropdown entries grouped by family: ("family › name", name)."""
    return [(f"{family} › {s.name}", s.name) for family, items in by_family().items() for s in items]


def strategy_info(name: str) -> str:
    strategy = REGISTRY.get(name)
    if strategy is None:
        return ""
    return f"**{strategy.name}** ({strategy.family}): {strategy.summary}  \n*Paper:* {strategy.paper}"


def param_control(spec) -> gr.components.Component:
    """A control for one ParamSpec: dropdown for choices, checkbox for bools, slider for bounded numbers."""
    if spec.choices:
        return gr.Dropdown(list(spec.choices), value=spec.default, label=spec.name, info=spec.help)
    if spec.type == "bool":
        return gr.Checkbox(value=spec.default, label=spec.name, info=spec.help)
    if spec.type in ("int", "float") and spec.low is not None and spec.high is not None:
        step = 1 if spec.type == "int" else 0.01
        return gr.Slider(spec.low, spec.high, value=spec.default, step=step, label=spec.name, info=spec.help)
    if spec.type in ("int", "float"):
        return gr.Number(
            value=spec.default, label=spec.name, info=spec.help, precision=0 if spec.type == "int" else None
        )
    return gr.Textbox(value=spec.default, label=spec.name, info=spec.help)


def stats_markdown(trace: Trace, status: str = "") -> str:
    stats = summarize(trace.events)
    rows = [
        ("tokens", stats.new_tokens),
        ("tokens/s", stats.tokens_per_s),
        ("target forwards", stats.target_forwards),
        ("forwards/token", stats.forwards_per_token),
        ("stop", status or stats.stop_reason),
    ]
    return (
        "| "
        + " | ".join(k for k, _ in rows)
        + " |\n|"
        + "---|" * len(rows)
        + "\n| "
        + " | ".join(str(v) for _, v in rows)
        + " |"
    )


def write_trace_file(trace_json: str) -> str:
    """Save a trace for download; the folder keeps at most MAX_TRACE_FILES files (oldest removed)."""
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    old = sorted(TRACE_DIR.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for path in old[: max(0, len(old) - MAX_TRACE_FILES + 1)]:
        path.unlink(missing_ok=True)
    path = TRACE_DIR / f"trace-{uuid.uuid4().hex[:12]}.json"
    path.write_text(trace_json, encoding="utf-8")
    return str(path)


def render(trace: Trace, final: bool, status: str = "") -> list:
    """One update of every output; the trace JSON and file only at the end (gr.skip() while streaming).

    Order: token view, main figure, stats, text, trace JSON, trace file, then the detail figures (hidden slots
    for strategies with fewer views)."""
    figures = strategy_figures(trace.strategy, trace.events)[:MAX_FIGURES]
    details = [gr.Plot(value=f, visible=True) for f in figures[1:]]
    details += [gr.Plot(visible=False)] * (MAX_FIGURES - len(figures))
    outputs = [strategy_token_view(trace.strategy, trace.events), figures[0], stats_markdown(trace, status), trace.text]
    if not final:
        return outputs + [gr.skip(), gr.skip(), *details]
    trace_json = to_json(trace)
    return outputs + [trace_json, write_trace_file(trace_json), *details]


def stream_outputs(strategy: str, prompt: str, params: dict, chat: bool, seed, model: str, device: str, dtype: str):
    """Validate, load, then stream throttled renders of the strategy's events until it ends or is stopped."""
    try:
        request = validate_request(
            strategy, prompt, params, chat=chat, seed=seed, model=model, device=device, dtype=dtype
        )
    except InputError as error:
        raise gr.Error(str(error)) from None
    trace = new_trace(request)
    loading = stats_markdown(trace, f"loading {request.model} …")
    yield [gr.skip(), empty_figure(), loading, "", gr.skip(), gr.skip()] + [gr.skip()] * (MAX_FIGURES - 1)
    try:
        loaded, prompt_ids = prepare(request)
    except (InputError, ModelLoadError) as error:
        raise gr.Error(str(error)) from None
    events = stream_run(request, loaded, prompt_ids)
    started = last_render = time.monotonic()
    status = ""
    try:
        for event in events:
            trace.events.append(event)
            now = time.monotonic()
            if now - started > MAX_RUN_SECONDS:
                status = f"stopped at the {MAX_RUN_SECONDS} s limit"
                break
            if now - last_render >= RENDER_INTERVAL_S:
                last_render = now
                yield render(trace, final=False)
    except InputError as error:  # a strategy may reject a parameter combination once it sees the prompt
        raise gr.Error(str(error)) from None
    finally:
        events.close()  # frees the strategy's caches, also when the client cancels
    yield render(trace, final=True, status=status)


def parse_params_json(params_json: str | None) -> dict:
    if not params_json or not params_json.strip():
        return {}
    if len(params_json) > MAX_PARAMS_JSON_CHARS:
        raise gr.Error(f"params_json is longer than {MAX_PARAMS_JSON_CHARS} characters.")
    try:
        params = json.loads(params_json)
    except ValueError as error:
        raise gr.Error(f"params_json is not valid JSON: {error}") from None
    if not isinstance(params, dict):
        raise gr.Error('params_json must be a JSON object such as {"temperature": 0.7}.')
    return params


def run_api(model: str, strategy: str, prompt: str, chat: bool, max_new_tokens: int, seed: int, params_json: str):
    """Stable endpoint `/run` for gradio_client: strategy parameters as a JSON object."""
    params = {**parse_params_json(params_json), "max_new_tokens": max_new_tokens}
    yield from stream_outputs(strategy, prompt, params, chat, seed, model, "auto", "auto")


def build_controls() -> tuple[dict[str, gr.Group], list[tuple[str, str, gr.components.Component]]]:
    """One (hidden unless selected) group of parameter controls per strategy."""
    groups, controls = {}, []
    for name, strategy in REGISTRY.items():
        specs = [spec for spec in param_specs(strategy.Params) if not spec.common]
        with gr.Group(visible=name == "greedy") as group:
            for spec in specs:
                controls.append((name, spec.name, param_control(spec)))
        groups[name] = group
    return groups, controls


def inspect_trace(trace_json: str, step: float, gamma: float):
    """Re-render one step of the last run from its trace (no model work): the strategy's own inspector."""
    if not trace_json:
        return empty_figure("Inspect a step", "Run a strategy first"), gr.skip()
    try:
        trace = from_json(trace_json)
    except TraceError as error:
        raise gr.Error(f"Cannot read the trace: {error}") from None
    figure = inspect_step(trace.strategy, trace.events, int(step or 0), gamma=gamma)
    return figure, gr.Slider(visible="gamma" in strategy_view(trace.strategy).knobs)


def build_api_inputs() -> tuple[list[gr.components.Component], gr.Button]:
    """Hidden, unconstrained inputs of the `/run` endpoint, so every value reaches `lab.validation`."""
    inputs = [
        gr.Textbox(visible=False, label="model"),
        gr.Textbox(visible=False, label="strategy"),
        gr.Textbox(visible=False, label="prompt"),
        gr.Checkbox(visible=False, label="chat"),
        gr.Number(visible=False, label="max_new_tokens"),
        gr.Number(visible=False, label="seed"),
        gr.Textbox(visible=False, label="params_json"),
    ]
    return inputs, gr.Button(visible=False)


def build_app() -> gr.Blocks:
    """The whole UI; nothing is loaded until the first run."""
    with gr.Blocks(title="Decoding Lab") as demo:
        gr.Markdown("# Decoding Lab\nRun a decoding strategy on a real model and watch what it does, token by token.")
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                model = gr.Dropdown(MODEL_CHOICES, value=EMBEDDED_MODEL, allow_custom_value=True, label="Model")
                with gr.Row():
                    device = gr.Dropdown(["auto", "cpu", "cuda", "mps"], value="auto", label="Device")
                    dtype = gr.Dropdown(["auto", "float32", "bfloat16", "float16"], value="auto", label="dtype")
                strategy = gr.Dropdown(strategy_choices(), value="greedy", label="Strategy")
                info = gr.Markdown(strategy_info("greedy"))
                groups, controls = build_controls()
                max_new_tokens = gr.Slider(
                    1, 1024, value=COMMON_DEFAULTS.max_new_tokens, step=1, label="max_new_tokens"
                )
                seed = gr.Number(value=0, precision=0, minimum=0, label="seed")
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=4, placeholder="Ask the model something…")
                chat = gr.Checkbox(value=True, label="Wrap in the model's chat template")
                with gr.Row():
                    run = gr.Button("Run", variant="primary")
                    stop = gr.Button("Stop", variant="stop")
                stats = gr.Markdown()
                tokens = gr.HTML(label="Tokens")
                figure = gr.Plot(label="Internals")
                detail_plots = [gr.Plot(visible=False, label="Details") for _ in range(MAX_FIGURES - 1)]
                text = gr.Textbox(label="Text", lines=4, interactive=False)
                with gr.Accordion("Inspect a step (re-rendered from the trace, no model run)", open=False):
                    with gr.Row():
                        inspect_step_number = gr.Number(value=0, precision=0, minimum=0, label="step")
                        inspect_gamma = gr.Slider(0.0, 5.0, value=1.5, step=0.1, label="gamma", visible=False)
                    inspect_plot = gr.Plot(label="Step detail")
                trace_file = gr.File(label="Trace (JSON)", interactive=False)
                trace_json = gr.Textbox(visible=False)
                gr.Examples([[p.text] for p in BUILTIN_PROMPTS], inputs=[prompt], label="Example prompts")
                api_inputs, api_trigger = build_api_inputs()

        def on_strategy(name: str) -> list:
            return [strategy_info(name)] + [gr.Group(visible=key == name) for key in groups]

        strategy.change(on_strategy, [strategy], [info, *groups.values()], api_visibility="private")

        def run_ui(model_, device_, dtype_, strategy_, prompt_, chat_, max_new_, seed_, *values):
            params = {p: v for (s, p, _), v in zip(controls, values, strict=True) if s == strategy_}
            params["max_new_tokens"] = max_new_
            yield from stream_outputs(strategy_, prompt_, params, chat_, seed_, model_, device_, dtype_)

        outputs = [tokens, figure, stats, text, trace_json, trace_file, *detail_plots]
        shared = {"concurrency_id": "model", "concurrency_limit": 1, "time_limit": MAX_RUN_SECONDS + 120}
        ui_inputs = [model, device, dtype, strategy, prompt, chat, max_new_tokens, seed, *(c for _, _, c in controls)]
        ui_event = run.click(run_ui, ui_inputs, outputs, api_visibility="private", **shared)
        submit_event = prompt.submit(run_ui, ui_inputs, outputs, api_visibility="private", **shared)
        api_event = api_trigger.click(run_api, api_inputs, outputs, api_name="run", **shared)
        stop.click(None, None, None, cancels=[ui_event, submit_event, api_event])
        inspect_inputs = [trace_json, inspect_step_number, inspect_gamma]
        gr.on(
            [trace_json.change, inspect_step_number.change, inspect_gamma.release],
            inspect_trace,
            inspect_inputs,
            [inspect_plot, inspect_gamma],
            api_visibility="private",
            concurrency_id="inspect",
        )
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
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
    )


if __name__ == "__main__":
    main()
