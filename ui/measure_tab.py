"""The Measure tab: `lab.tools.measure` (run_bench on a small subset plus a quality score) on the Run tab's model with a
progress bar, drawn as a quality-throughput map, acceptance rate vs speedup on the theoretical curves, and a
selection matrix (`visualizers.measure`). A benchmark holds the model queue for its whole duration."""

from __future__ import annotations

import json

import gradio as gr

from lab.app import learn
from lab.engine.models import ModelLoadError
from lab.params import InputError
from lab.tools.measure import DEFAULT_LIMIT, DEFAULT_STRATEGIES, DEFAULT_TOKENS, measure
from strategies import REGISTRY
from ui.common import HUB, LIGHT, MEASURE_TIME_LIMIT, STATE_TTL_S, write_trace_file
from visualizers.measure import acceptance_speedup_figure, quality_throughput_figure, selection_matrix_figure

EXPLAIN = (
    "Runs `lab bench` (interleaved, after a warm-up) on the Run tab's model with each strategy's default parameters "
    "over the first builtin prompts, then re-runs each output with the same seed and scores it: *quality* is the "
    "target model's mean log-probability per output token (nats, temperature 1), a likelihood, not a human "
    "judgement. Strategies that cannot run here (e.g. heads not trained for this model) are skipped with the reason. "
    "A few minutes on a CPU; it holds the model queue while it runs."
)
TABLE_KEYS = ("name", "family", "tokens_per_s", "speedup", "quality", "acceptance_rate", "mean_accepted_length")


def table_markdown(result: dict) -> str:
    rows = result["rows"]
    lines = ["| " + " | ".join(TABLE_KEYS) + " |", "|" + "---|" * len(TABLE_KEYS)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row.get(k) is None else str(row[k]) for k in TABLE_KEYS) + " |")
    c = result["config"]
    head = (
        f"{c['model']} on {c['device']} ({c['dtype']}, {c['threads']} threads), {c['n_prompts']} builtin prompts, "
        f"max_new_tokens={c['max_new_tokens']}; speedup vs {rows[0]['name']}; quality = {c['quality']}.\n\n"
    )
    skipped = "".join(f"\n\n*Skipped {name}:* {error}" for name, error in result["skipped"].items())
    return head + "\n".join(lines) + skipped


def figures(result: dict | None, language: str) -> list:
    rows = result["rows"] if result else []
    code = learn.LANGUAGES.get(language, "en")
    cells = {row["name"]: learn.matrix_cells(row["name"], code) for row in rows}
    matrix = selection_matrix_figure(rows, cells, learn.matrix_headings(code))
    return [quality_throughput_figure(rows), acceptance_speedup_figure(rows), matrix]


def run_measure(names, limit, tokens, model, device, dtype, precision, language, progress=gr.Progress()):
    """Benchmark the selected strategies; progress goes to the bar."""
    try:
        with HUB.model_lock:  # never beside a Run of the shared model lane
            result = measure(
                list(names or []),
                limit=int(limit),
                max_new_tokens=int(tokens),
                model=model,
                device=device,
                dtype=dtype,
                precision=precision,
                progress=lambda fraction, message: progress(fraction, desc=message),
            )
    except (InputError, ModelLoadError) as error:
        raise gr.Error(str(error)) from None
    path = write_trace_file(json.dumps(result, ensure_ascii=False, indent=1), prefix="measure")
    return [table_markdown(result), *figures(result, language), path, result]


def build_measure_tab(settings: dict, language: gr.Radio) -> None:
    default = [name for name in DEFAULT_STRATEGIES if name in REGISTRY]
    names = gr.CheckboxGroup(list(REGISTRY), value=default, label="Strategies", elem_id="measure-strategies")
    with gr.Row():
        limit = gr.Slider(1, 8, value=DEFAULT_LIMIT, step=1, label="builtin prompts", elem_id="measure-prompts")
        tokens = gr.Slider(8, 256, value=DEFAULT_TOKENS, step=8, label="max_new_tokens", elem_id="measure-tokens")
        run = gr.Button("Run benchmark", variant="primary", elem_id="measure-run")
    gr.Markdown(EXPLAIN)
    table = gr.Markdown(elem_id="measure-table")
    quality = gr.Plot(label="Quality vs throughput", elem_id="measure-quality")
    acceptance = gr.Plot(label="Acceptance vs speedup", elem_id="measure-acceptance")
    matrix = gr.Plot(label="Selection matrix", elem_id="measure-matrix")
    download = gr.File(label="Measured numbers (JSON)", interactive=False, elem_id="measure-file")
    state = gr.State(None, time_to_live=STATE_TTL_S)
    inputs = [names, limit, tokens, settings["model"], settings["device"], settings["dtype"], settings["precision"]]
    inputs.append(language)
    run.click(
        run_measure,
        inputs,
        [table, quality, acceptance, matrix, download, state],
        api_visibility="private",
        concurrency_id="model",
        concurrency_limit=1,
        time_limit=MEASURE_TIME_LIMIT,
    )
    language.change(figures, [state, language], [quality, acceptance, matrix], **LIGHT)
