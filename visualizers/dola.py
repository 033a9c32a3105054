"""DoLa's live views (Chuang et al. 2024), drawn from the `LayerContrast` events a run emits.

Covers four figures, each with an empty state before the first step:
- `divergence_figure` (main view): the JSD of each candidate premature layer from the final layer at the latest
  step, the chosen layer M (argmax, Eq. 3) drawn in a different colour and labelled;
- `divergence_heatmap_figure`: candidate layers x generated tokens heatmap of the JSD (as the paper's Figure 2),
  the chosen layer of each step marked;
- `lens_figure`: the logit lens, top-1 token of each layer the run computed (the candidates and the final layer,
  every layer 1..N with `lens_all_layers`) at each generated position, written in the cells (repeats kept
  distinct), coloured by agreement with the final layer;
- `topk_compare_figure`: top-8 of the final, premature (layer M), contrast and after-penalty distributions at the
  latest step, as small multiples, with the emitted token highlighted.
`highlight_steps` gives the steps where DoLa's token differs from plain greedy's (argmax of the final layer after
the same repetition penalty). "JSD" is the divergence as transformers' DoLa computes it (KL(M || .) terms
averaged over the vocabulary, see `strategies.dola.js_divergences`), hence its small scale. Imports plotly, the
standard library and lab.trace only.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.trace import Event, LayerContrast
from visualizers.labels import NARROW_PLOT_PX, cell_text
from visualizers.style import STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

PLACEHOLDER = "No DoLa steps yet"
HIGHLIGHT_LABEL = "DoLa differs from greedy"
CHOSEN_COLOR = STATUS_COLORS["recovered"]
CANDIDATE_COLOR = STATUS_COLORS["bonus"]
EMITTED_COLOR = STATUS_COLORS["accepted"]
MAX_HEATMAP_STEPS = 64
MAX_LENS_STEPS = 32


def contrast_steps(events: list[Event]) -> list[LayerContrast]:
    return [e for e in events if isinstance(e, LayerContrast)]


def highlight_steps(events: list[Event]) -> set[int]:
    """Steps where the emitted token is not what plain greedy (final layer + repetition penalty) would pick."""
    return {e.step for e in contrast_steps(events) if e.token_id != e.greedy_token_id}


def divergence_figure(events: list[Event]) -> go.Figure:
    """Bar chart of JSD(q_N || q_j) over the candidate layers at the latest step; the chosen layer marked."""
    steps = contrast_steps(events)
    title = "Layer divergence JSD(final || layer j), latest step"
    if not steps:
        return empty_figure(title, PLACEHOLDER)
    last = steps[-1]
    labels = [f"L{layer}" for layer in last.candidate_layers]
    colors = [CHOSEN_COLOR if layer == last.chosen_layer else CANDIDATE_COLOR for layer in last.candidate_layers]
    bars = go.Bar(
        x=labels,
        y=last.divergences,
        marker={"color": colors},
        name="JSD",
        customdata=[
            f"layer {layer}{' (chosen M)' if layer == last.chosen_layer else ''}<br>JSD = {d:.3e}"
            for layer, d in zip(last.candidate_layers, last.divergences, strict=True)
        ],
        hovertemplate="%{customdata}<extra></extra>",
    )
    fig = go.Figure([bars], layout=base_layout(f"{title} (step {last.step}, mode {last.mode})", height=300))
    chosen = last.candidate_layers.index(last.chosen_layer)
    fig.add_annotation(
        x=labels[chosen], y=last.divergences[chosen], text=f"M = {last.chosen_layer}", showarrow=True, arrowhead=2
    )
    fig.update_xaxes(title_text="candidate premature layer j", type="category")
    fig.update_yaxes(title_text="JSD (mean over vocab)", exponentformat="e")
    fig.update_layout(showlegend=False)
    return fig


def divergence_heatmap_figure(events: list[Event], max_steps: int = MAX_HEATMAP_STEPS) -> go.Figure:
    """Candidate layers x generated steps heatmap of the JSD (paper Figure 2); chosen layers marked."""
    steps = contrast_steps(events)[-max(1, max_steps) :]
    title = "JSD per candidate layer and generated token"
    if not steps:
        return empty_figure(title, PLACEHOLDER)
    layers = sorted({layer for e in steps for layer in e.candidate_layers})
    xs = [e.step for e in steps]
    z: list[list[float | None]] = [[None] * len(steps) for _ in layers]
    for col, e in enumerate(steps):
        for layer, d in zip(e.candidate_layers, e.divergences, strict=True):
            z[layers.index(layer)][col] = d
    heatmap = go.Heatmap(
        x=xs,
        y=layers,
        z=z,
        colorscale="Viridis",
        colorbar={"title": {"text": "JSD"}, "thickness": 12, "exponentformat": "e"},
        hovertemplate="step %{x}<br>layer %{y}<br>JSD = %{z:.3e}<extra></extra>",
        xgap=1,
        ygap=1,
        name="JSD",
    )
    chosen = go.Scatter(
        x=xs,
        y=[e.chosen_layer for e in steps],
        mode="markers",
        name="chosen layer M",
        marker={"symbol": "square-open", "size": 12, "color": CHOSEN_COLOR, "line": {"width": 2}},
        hovertemplate="step %{x}<br>chosen layer %{y}<extra></extra>",
    )
    fig = go.Figure([heatmap, chosen], layout=base_layout(title, height=max(260, 90 + 22 * len(layers))))
    words = distinct_labels([display_token(e.token_text) for e in steps])
    fig.update_xaxes(title_text="generated token", tickvals=xs, ticktext=words, tickangle=-60, automargin=True)
    fig.update_yaxes(title_text="layer", type="category", categoryorder="array", categoryarray=layers)
    fig.update_layout(showlegend=False, margin={"l": 56, "r": 24, "t": 44, "b": 90})
    return fig


def _lens_grid(steps: list[LayerContrast], layers: list[int]) -> tuple[list[list], list[list], list[list]]:
    """Layer x step grids: agreement with the final layer (1 / 0 / None), cell texts and hover texts."""
    z = [[None] * len(steps) for _ in layers]
    text = [[""] * len(steps) for _ in layers]
    hover = [[""] * len(steps) for _ in layers]
    for col, e in enumerate(steps):
        final = e.lens_tokens[-1] if e.lens_tokens else None
        for layer, token in zip(e.lens_layers, e.lens_tokens, strict=True):
            row = layers.index(layer)
            z[row][col] = 1.0 if token == final else 0.0
            text[row][col] = display_token(token)
            hover[row][col] = f"step {e.step}<br>layer {layer}<br>top-1 {display_token(token)}"
    flat = distinct_labels([cell for row in text for cell in row])
    text = [flat[r * len(steps) : (r + 1) * len(steps)] for r in range(len(layers))]
    return z, text, hover


def lens_figure(events: list[Event], max_steps: int = MAX_LENS_STEPS, width_px: float = NARROW_PLOT_PX) -> go.Figure:
    """Logit-lens grid: top-1 token of each layer's early exit at each generated position (the token written in
    cells wide enough at a plot `width_px`; hover always has it)."""
    steps = contrast_steps(events)[-max(1, max_steps) :]
    title = "Logit lens: top-1 token per layer (highlighted = agrees with the final layer)"
    if not steps:
        return empty_figure(title, PLACEHOLDER)
    layers = sorted({layer for e in steps for layer in e.lens_layers})
    z, text, hover = _lens_grid(steps, layers)
    height = max(300, 80 + 18 * len(layers))
    text = cell_text(text, len(steps), len(layers), width_px, height - 88, font=9)  # tokens only where they fit
    heatmap = go.Heatmap(
        x=[e.step for e in steps],
        y=layers,
        z=z,
        zmin=0.0,
        zmax=1.0,
        colorscale=[[0.0, "#f8fafc"], [1.0, "#bfdbfe"]],
        showscale=False,
        text=text,
        texttemplate="%{text}",
        textfont={"size": 9},
        customdata=hover,
        hovertemplate="%{customdata}<extra></extra>",
        xgap=1,
        ygap=1,
    )
    fig = go.Figure([heatmap], layout=base_layout(title, height=height))
    fig.update_xaxes(title_text="step", showgrid=False)
    fig.update_yaxes(title_text="layer", type="category", categoryorder="array", categoryarray=layers)
    return fig


def topk_compare_figure(events: list[Event]) -> go.Figure:
    """Top-8 of final / premature / contrast / after-penalty at the latest step, one panel each."""
    steps = contrast_steps(events)
    title = "Top-8 per distribution, latest step"
    if not steps:
        return empty_figure(title, PLACEHOLDER)
    last = steps[-1]
    names = [f"{label} (L{last.chosen_layer})" if label == "premature" else label for label in last.top_labels]
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.07)
    panels = zip(last.top_ids, last.top_tokens, last.top_probs, strict=True)
    for col, (ids, tokens, probs) in enumerate(panels, start=1):
        labels = distinct_labels([display_token(t) for t in tokens])
        colors = [EMITTED_COLOR if i == last.token_id else CANDIDATE_COLOR for i in ids]
        fig.add_trace(
            go.Bar(
                x=probs,
                y=labels,
                orientation="h",
                marker={"color": colors},
                hovertemplate="%{y}<br>p = %{x:.4f}<extra></extra>",
                name=names[col - 1],
            ),
            row=1,
            col=col,
        )
        fig.update_yaxes(autorange="reversed", row=1, col=col)
        fig.update_xaxes(range=[0, 1], row=1, col=col)
    subtitle = f"{title} (step {last.step}; emitted {display_token(last.token_text)} in green)"
    fig.update_layout(**base_layout(subtitle, height=320), showlegend=False)
    return fig


VIEWS = {
    "dola": StrategyView(
        figures=(divergence_figure, divergence_heatmap_figure, lens_figure, topk_compare_figure),
        highlight_steps=highlight_steps,
        highlight_label=HIGHLIGHT_LABEL,
    ),
}
