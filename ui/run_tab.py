"""The Run tab: one strategy on one prompt, streamed live with all its views, the step inspector, presets and
controls generated from the strategy's Params (those without effect under the current settings hidden), and
the stable `/run` API endpoint for gradio_client.
"""

from __future__ import annotations

import json
import time

import gradio as gr

from lab.app import replay
from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.app.controls import dependencies, visibility
from lab.app.pacing import PACES, REALTIME, STEP
from lab.app.presets import DEFAULTS, preset_values, presets_for
from lab.app.runner import new_trace
from lab.engine.models import EMBEDDED_MODEL
from lab.engine.quant import PRECISIONS
from lab.params import InputError, build_params, param_specs
from strategies import REGISTRY
from ui.branch_panel import build_branch_panel, wire_branch_panel
from ui.common import (
    COMMON_DEFAULTS,
    LIGHT,
    MAX_PARAMS_JSON_CHARS,
    MAX_RUN_SECONDS,
    MODEL_CHOICES,
    RUN_QUEUE,
    STATE_TTL_S,
    checked_request,
    render,
    session_pace,
    speed_stats,
    start_pacing,
    stats_markdown,
    strategy_choices,
    strategy_info,
    stream_trace,
    view_updates,
)
from ui.inspector import build_inspector, wire_inspector
from ui.layout import MAX_FIGURES, PRESENT_JS, build_views, step_buttons, view_list
from visualizers import empty_figure

DEFAULT_PROMPT = "Describe a rainy morning in a busy city in three sentences."
EXAMPLES_PER_PAGE = 4


def stream_outputs(
    strategy: str,
    prompt: str,
    params: dict,
    chat: bool,
    seed,
    model: str,
    device: str,
    dtype: str,
    precision="auto",
    control=None,
):
    """Validate, then stream throttled renders of the strategy's events until it ends, is stopped or times out;
    with a PaceControl the renders follow its pace (the run itself is not slowed), and the control stops being live
    before the final update goes out: Gradio resumes a generator (and runs its caller's cleanup) only after the
    browser has that update, and a ◀ / ▶ pressed in between would otherwise go to the finished run's pacer."""
    options = {"chat": chat, "seed": seed, "model": model, "device": device, "dtype": dtype, "precision": precision}
    request = checked_request(strategy, prompt, params, **options)
    loading = stats_markdown(new_trace(request), f"loading {request.model} …")
    yield [gr.skip(), empty_figure(), loading, "", gr.skip(), gr.skip()] + [gr.skip()] * MAX_FIGURES
    for shown, final, status, full in stream_trace(request, time.monotonic() + MAX_RUN_SECONDS, control=control):
        update = render(shown, final, status, full)
        if final:
            update[-1]["request"] = request
            update[2] = stats_markdown(shown, status, *speed_stats(shown, request))
            if control is not None:
                control.live = False
        yield update


def refusal(message: str) -> list:
    """The Run tab's update for a run that could not start or failed: the message (which names the field) where the
    stats go; the other views keep what they showed."""
    return [gr.skip(), gr.skip(), f"**Cannot run:** {message}", *[gr.skip()] * (3 + MAX_FIGURES)]


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


def param_control(spec, elem_id: str | None = None) -> gr.components.Component:
    """A control for one ParamSpec: dropdown for choices, checkbox for bools, slider for bounded numbers."""
    if spec.choices:
        return gr.Dropdown(list(spec.choices), value=spec.default, label=spec.name, info=spec.help, elem_id=elem_id)
    if spec.type == "bool":
        return gr.Checkbox(value=spec.default, label=spec.name, info=spec.help, elem_id=elem_id)
    if spec.type in ("int", "float") and spec.low is not None and spec.high is not None:
        step = 1 if spec.type == "int" else 0.01
        return gr.Slider(
            spec.low, spec.high, value=spec.default, step=step, label=spec.name, info=spec.help, elem_id=elem_id
        )
    if spec.type in ("int", "float"):
        return gr.Number(
            value=spec.default,
            label=spec.name,
            info=spec.help,
            precision=0 if spec.type == "int" else None,
            elem_id=elem_id,
        )
    return gr.Textbox(value=spec.default, label=spec.name, info=spec.help, elem_id=elem_id)


def build_controls() -> tuple[dict[str, gr.Group], list[tuple[str, str, gr.components.Component]], dict]:
    """One (hidden unless selected) group of parameter controls per strategy; controls that have no effect
    under the defaults (lab.app.controls) start hidden. A strategy that can write a prompt from its settings
    (`Strategy.task_prompt`, RLM's task question) gets a button for it under its controls."""
    groups, controls, prompt_buttons = {}, [], {}
    for name, strategy in REGISTRY.items():
        shown = visibility(strategy.Params, {})
        with gr.Group(visible=name == "greedy") as group:
            for spec in param_specs(strategy.Params):
                if not spec.common:
                    control = param_control(spec, elem_id=f"param-{name}-{spec.name}")
                    control.visible = shown[spec.name]
                    controls.append((name, spec.name, control))
            if strategy.task_prompt:
                prompt_buttons[name] = gr.Button(strategy.task_prompt[0], size="sm", elem_id=f"{name}-task-prompt")
        groups[name] = group
    return groups, controls, prompt_buttons


def wire_prompt_buttons(ui: dict) -> None:
    """A strategy's prompt button writes the prompt its settings give (shown in the prompt box, so the question
    asked is always the one on screen); settings that give none leave the prompt and say why."""
    controls = ui["controls"]
    for name, button in ui["prompt_buttons"].items():
        own = [(p, c) for s, p, c in controls if s == name]

        def write(prompt: str, *values, _name=name, _own=own):
            strategy = REGISTRY[_name]
            try:
                params = build_params(strategy.Params, {p: v for (p, _), v in zip(_own, values, strict=True)})
            except InputError as error:
                gr.Warning(str(error))
                return prompt
            written = strategy.task_prompt[1](params)
            if written is None:
                gr.Warning("These settings have no question of their own (pasted text): type yours in the prompt.")
                return prompt
            return written

        button.click(write, [ui["prompt"], *[c for _, c in own]], [ui["prompt"]], **LIGHT)


def wire_control_visibility(controls: list[tuple[str, str, gr.components.Component]]) -> None:
    """When a controlling parameter changes, show only its strategy's parameters that have an effect."""
    for name, strategy in REGISTRY.items():
        rules = dependencies(strategy.Params)
        own = [(p, c) for s, p, c in controls if s == name]
        controllers = {rule.controller for rule in rules.values()}
        if not controllers:
            continue

        def update(*values, _cls=strategy.Params, _own=own):
            shown = visibility(_cls, {p: v for (p, _), v in zip(_own, values, strict=True)})
            return [gr.update(visible=shown[p]) for p, _ in _own]

        triggers = [c.change for p, c in own if p in controllers]
        gr.on(triggers, update, [c for _, c in own], [c for _, c in own], **LIGHT)


def build_api_inputs() -> tuple[list[gr.components.Component], gr.Button]:
    """Hidden, unconstrained inputs of the `/run` endpoint, so every value reaches `lab.app.validation`."""
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


def preset_updates(strategy: str, preset: str, controls: list) -> list:
    """Fill the strategy's controls from a preset; other strategies' controls are left alone."""
    found = REGISTRY.get(strategy)
    if found is None:
        return [gr.skip()] * len(controls)
    values = preset_values(strategy, found.Params, preset or DEFAULTS)
    return [gr.update(value=values[p]) if s == strategy else gr.skip() for s, p, _ in controls]


def build_settings() -> dict:
    """The left column: model, device, dtype, weight precision, strategy (+ info, preset, its controls), budget
    and seed."""
    ui = {
        "model": gr.Dropdown(
            MODEL_CHOICES, value=EMBEDDED_MODEL, allow_custom_value=True, label="Model", elem_id="model"
        )
    }
    with gr.Row():
        ui["device"] = gr.Dropdown(["auto", "cpu", "cuda", "mps"], value="auto", label="Device", elem_id="device")
        ui["dtype"] = gr.Dropdown(
            ["auto", "float32", "bfloat16", "float16"], value="auto", label="dtype", elem_id="dtype"
        )
        ui["precision"] = gr.Dropdown(
            list(PRECISIONS),
            value="auto",
            label="weights",
            info="bf16 = float weights in dtype; on CPU int8, int4 (the GGUF's own 4-bit blocks), w4a8 (those blocks "
            "with 8-bit activations and integer dot products); auto = fastest here (w4a8 on most x86 CPUs)",
            elem_id="precision",
        )
    ui["strategy"] = gr.Dropdown(strategy_choices(), value="greedy", label="Strategy", elem_id="strategy")
    ui["info"] = gr.Markdown(strategy_info("greedy"))
    ui["preset"] = gr.Dropdown(
        presets_for("greedy", REGISTRY["greedy"].Params), value=DEFAULTS, label="Preset", elem_id="preset"
    )
    ui["groups"], ui["controls"], ui["prompt_buttons"] = build_controls()
    ui["max_new_tokens"] = gr.Slider(
        1, 1024, value=COMMON_DEFAULTS.max_new_tokens, step=1, label="max_new_tokens", elem_id="max-new-tokens"
    )
    ui["seed"] = gr.Number(value=0, precision=0, minimum=0, label="seed", elem_id="seed")
    return ui


def wire_settings(ui: dict) -> None:
    groups, controls = ui["groups"], ui["controls"]

    def on_strategy(name: str) -> list:
        found = REGISTRY.get(name)
        choices = presets_for(name, found.Params) if found else [DEFAULTS]
        preset = gr.Dropdown(choices=choices, value=DEFAULTS)
        return [strategy_info(name), preset] + [gr.Group(visible=key == name) for key in groups]

    ui["strategy"].change(on_strategy, [ui["strategy"]], [ui["info"], ui["preset"], *groups.values()], **LIGHT)
    ui["preset"].input(
        lambda strategy, preset: preset_updates(strategy, preset, controls),
        [ui["strategy"], ui["preset"]],
        [c for _, _, c in controls],
        **LIGHT,
    )
    wire_control_visibility(controls)


def build_run_tab() -> dict:
    """The Run tab's components and its model events (the app chains the history onto them)."""
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=280, elem_id="run-settings"):
            ui = build_settings()
        with gr.Column(scale=4, min_width=320):
            with gr.Row(equal_height=False):
                ui["prompt"] = gr.Textbox(
                    DEFAULT_PROMPT,
                    label="Prompt",
                    lines=2,
                    placeholder="Ask the model something…",
                    elem_id="prompt",
                    scale=5,
                )
                with gr.Column(scale=1, min_width=150, elem_id="run-stop"):
                    run = gr.Button("Run", variant="primary", elem_id="run-button")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop-button")
            # closed, so the token view and the figure stay on a 1280 x 720 screen while a run streams
            with gr.Accordion(
                "Example prompts (open to pick one)",
                open=False,
                elem_classes=["dl-hide-present"],
                elem_id="example-prompts",
            ):
                gr.Examples(
                    [[p.text] for p in BUILTIN_PROMPTS],
                    inputs=[ui["prompt"]],
                    label="Example prompts (click one)",
                    examples_per_page=EXAMPLES_PER_PAGE,
                )
            with gr.Row(equal_height=True, elem_id="run-controls"):
                ui["chat"] = gr.Checkbox(value=True, label="chat template", elem_id="chat", scale=0, min_width=140)
                ui["pace"] = gr.Radio(list(PACES), value=REALTIME, label="Pace", elem_id="pace", scale=3)
                ui["back"], ui["next"] = step_buttons("")
                present = gr.Button("Presentation mode", elem_id="present-button", scale=0, min_width=170)
            views = build_views("")
            inspector = build_inspector("")
            branch = build_branch_panel()
            with gr.Row(elem_classes=["dl-hide-present"]):
                trace_file = gr.File(label="Trace (JSON)", interactive=False, elem_id="trace-file")
            trace_json = gr.Textbox(visible=False)
            api_inputs, api_trigger = build_api_inputs()
    ui["state"] = gr.State(None, time_to_live=STATE_TTL_S)
    wire_settings(ui)
    wire_prompt_buttons(ui)
    controls = ui["controls"]

    def run_ui(
        request: gr.Request, model_, device_, dtype_, precision_, strategy_, prompt_, chat_, max_new_, seed_, pace_,
        *values,
    ):  # fmt: skip
        params = {p: v for (s, p, _), v in zip(controls, values, strict=True) if s == strategy_}
        params["max_new_tokens"] = max_new_
        control = start_pacing(request, pace_)
        try:
            yield from stream_outputs(
                strategy_, prompt_, params, chat_, seed_, model_, device_, dtype_, precision_, control
            )
        except gr.Error as error:  # shown once, in the stats' place (no toast, no Error badge on every view)
            yield refusal(str(error.message))
        finally:
            control.live = False

    outputs = [views["tokens"], views["main"], views["stats"], views["text"], trace_json, trace_file]
    outputs += [*views["details"], ui["state"]]
    keys = ("model", "device", "dtype", "precision", "strategy", "prompt", "chat", "max_new_tokens", "seed", "pace")
    ui_inputs = [ui[k] for k in keys] + [c for _, _, c in controls]
    ui["events"] = [
        run.click(run_ui, ui_inputs, outputs, api_visibility="private", **RUN_QUEUE),
        ui["prompt"].submit(run_ui, ui_inputs, outputs, api_visibility="private", **RUN_QUEUE),
        api_trigger.click(run_api, api_inputs, outputs, api_name="run", **RUN_QUEUE),
    ]
    present.click(None, None, None, js=PRESENT_JS)
    wire_stepping(ui, views)
    wire_inspector(inspector, ui["state"], [(views["tokens"], lambda state: state["trace"] if state else None)])
    wire_branch_panel(branch, ui["state"], views["tokens"], ui["pace"])
    ui["branch"] = branch
    # Stop ends the session's live run (or branch) as a result: its handler sees the request and yields a final,
    # complete update (cancelling the event instead would leave Gradio's red Error badges on every output)
    stop.click(stop_session, None, None, **LIGHT)
    return ui


def stop_session(request: gr.Request) -> None:
    """Stop: the session's live run ends with what it has shown so far (`ui.common.stream_trace`)."""
    session_pace(request).request_stop()


def ended_status(state: dict) -> str:
    """What the stats say at the end of a finished run being stepped: a stop by the viewer or the time limit; ""
    otherwise (the stats then read the run's own stop reason)."""
    status = state.get("status", "")
    return status if status.startswith("stopped") else ""


def wire_stepping(ui: dict, views: dict) -> None:
    """The pace radio reaches a live run (after a run, leaving step mode shows the whole run); ◀ / ▶ (and the
    arrow keys) release a token in step mode while a run streams, and otherwise step through the finished run
    token by token; the stats say which token is shown."""
    outputs = [*view_list(views), ui["state"]]

    def show(state: dict, position: int) -> list:
        shown = replay.trace_at_token(state["trace"], position)
        status = replay.position_status(state["trace"], shown, ended_status(state))
        return [*view_updates(shown, status), {**state, "position": position}]

    def on_pace(request: gr.Request, state: dict | None, pace: str):
        control = session_pace(request)
        control.set_pace(pace)
        if getattr(control, "live", False) or not state or pace == STEP:
            return [gr.skip()] * len(outputs)
        return show(state, replay.token_count(state["trace"]))

    ui["pace"].change(on_pace, [ui["state"], ui["pace"]], outputs, **LIGHT)

    def step(request: gr.Request, state: dict | None, delta: int):
        control = session_pace(request)
        if getattr(control, "live", False):
            control.step(delta)
            return [gr.skip()] * len(outputs)
        if not state:
            return [gr.skip()] * len(outputs)
        return show(state, max(0, min(state.get("position", 0) + delta, replay.token_count(state["trace"]))))

    def back(request: gr.Request, state: dict | None):
        return step(request, state, -1)

    def forward(request: gr.Request, state: dict | None):
        return step(request, state, 1)

    # every press counts (Gradio's default trigger_mode "once" drops a press made while the last one is pending), and
    # one at a time, so two quick presses do not both read the same position from the session's state
    steps = {**LIGHT, "concurrency_id": "step", "concurrency_limit": 1, "trigger_mode": "multiple"}
    ui["back"].click(back, [ui["state"]], outputs, **steps)
    ui["next"].click(forward, [ui["state"]], outputs, **steps)
