"""Inspecting one step of a finished (or running) trace: the distribution the token was drawn from.

`step_alternatives_figure(events, step)` draws the top-k alternatives of the step's first TokenEmitted as
horizontal bars (the emitted token highlighted). Strategies with richer per-step detail (CFG re-weighting at
another gamma, a speculative round's q vs p) provide their own inspector through `StrategyView.inspect`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from lab.trace import Event, TokenEmitted
from visualizers.style import STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure


def step_alternatives_figure(events: list[Event], step: int, **_knobs: float) -> go.Figure:
    """Top-k alternatives at `step` with their probabilities; the emitted token in the accepted colour."""
    event = next((e for e in events if isinstance(e, TokenEmitted) and e.step == step), None)
    title = f"Alternatives at step {step}"
    if event is None or not event.top_probs:
        return empty_figure(title, f"No token at step {step}")
    labels = distinct_labels([display_token(t) for t in event.top_tokens])
    colors = [STATUS_COLORS["accepted"] if i == event.token_id else STATUS_COLORS["target"] for i in event.top_ids]
    hover = [
        f"rank {r} · {label} · p={p:.4f}"
        for r, (label, p) in enumerate(zip(labels, event.top_probs, strict=True), start=1)
    ]
    fig = go.Figure(
        go.Bar(
            x=event.top_probs,
            y=labels,
            orientation="h",
            marker_color=colors,
            hovertext=hover,
            hoverinfo="text",
            text=[f"{p:.3f}" for p in event.top_probs],
            textposition="auto",
        ),
        layout=base_layout(f"{title}: emitted {display_token(event.text)!s}", 60 + 28 * len(labels)),
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title="p", range=[0, 1])
    return fig
