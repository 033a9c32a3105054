"""The baseline's per-step top-k chart: which tokens the model considered at each step, and how likely each was.

Covers: `topk_figure`, a heatmap with x = generation step (the last `max_steps` emitted tokens), y = rank 1..k
(rank 1 on top), colour = probability of the distribution sampled from, the token written in each cell
(repeated tokens kept distinct with zero-width non-joiners), hover text with step, rank, token and p, and an
open-square marker on the emitted token's rank (omitted when the emitted token is outside the top-k), plus
`empty_figure` for a run with no tokens yet. Strategies that emit several tokens in one step get one column
per token (the hover says the step). Not covered: the detail views of other strategies.
"""

from __future__ import annotations

import plotly.graph_objects as go

from lab.trace import Event, TokenEmitted
from visualizers.labels import NARROW_PLOT_PX, cell_text
from visualizers.style import (
    PROBABILITY_COLORSCALE,
    SELECTED_OUTLINE,
    base_layout,
    display_token,
    distinct_labels,
)

TITLE = "Top-k probabilities per step"
PLACEHOLDER = "No tokens yet"


def empty_figure(title: str = TITLE, message: str = PLACEHOLDER, height: int = 260) -> go.Figure:
    """A blank figure with a centred message, used before the first token arrives."""
    fig = go.Figure(layout=base_layout(title, height))
    fig.add_annotation(
        text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 14, "color": "#64748b"}
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def chosen_rank(event: TokenEmitted) -> int | None:
    """The 1-based rank of the emitted token among the step's alternatives, or None when it is not among them
    (matched by id; by text only when the event carries no ids)."""
    if event.top_ids:
        return event.top_ids.index(event.token_id) + 1 if event.token_id in event.top_ids else None
    return event.top_tokens.index(event.text) + 1 if event.text in event.top_tokens else None


def _grids(tokens: list[TokenEmitted], k: int) -> tuple[list[list], list[list], list[list]]:
    """Rank x step grids of probabilities, cell labels and hover texts (None / "" where a step has fewer than
    k alternatives)."""
    z = [[None] * len(tokens) for _ in range(k)]
    labels = [[""] * len(tokens) for _ in range(k)]
    hovers = [[""] * len(tokens) for _ in range(k)]
    for col, event in enumerate(tokens):
        for row, (token, prob) in enumerate(zip(event.top_tokens[:k], event.top_probs[:k], strict=False)):
            shown = display_token(token)
            z[row][col] = prob
            labels[row][col] = shown
            hovers[row][col] = f"step {event.step}<br>rank {row + 1}<br>token {shown}<br>p = {prob:.4f}"
    flat = distinct_labels([label for row in labels for label in row])
    labels = [flat[r * len(tokens) : (r + 1) * len(tokens)] for r in range(k)]
    return z, labels, hovers


def _chosen_markers(tokens: list[TokenEmitted], xs: list[int]) -> go.Scatter:
    """Open squares at the rank of each emitted token that is in its step's top-k."""
    points = [(x, chosen_rank(e), e) for x, e in zip(xs, tokens, strict=True)]
    points = [(x, r, e) for x, r, e in points if r is not None]
    return go.Scatter(
        x=[x for x, _, _ in points],
        y=[r for _, r, _ in points],
        mode="markers",
        name="emitted token",
        marker={"symbol": "square-open", "size": 26, "color": SELECTED_OUTLINE, "line": {"width": 2}},
        customdata=[f"step {e.step}<br>emitted {display_token(e.text)} at rank {r}" for _, r, e in points],
        hovertemplate="%{customdata}<extra></extra>",
    )


def topk_figure(events: list[Event], max_steps: int = 32, width_px: float = NARROW_PLOT_PX) -> go.Figure:
    """Heatmap of the top-k alternatives of the last `max_steps` emitted tokens: x = step, y = rank, colour = p,
    the token written in each cell when cells are wide enough at a plot `width_px` (hover always has it), and the
    emitted token's rank marked. An empty-state figure before any token."""
    tokens = [e for e in events if isinstance(e, TokenEmitted)][-max(1, max_steps) :]
    k = max((min(len(e.top_tokens), len(e.top_probs)) for e in tokens), default=0)
    if not tokens or k == 0:
        return empty_figure()
    first = len([e for e in events if isinstance(e, TokenEmitted)]) - len(tokens)
    xs = list(range(first, first + len(tokens)))
    z, labels, hovers = _grids(tokens, k)
    height = max(260, 70 + 32 * k)
    labels = cell_text(labels, len(tokens), k, width_px - 40, height - 88)  # the colour bar takes ~40 px
    heatmap = go.Heatmap(
        x=xs,
        y=list(range(1, k + 1)),
        z=z,
        zmin=0.0,
        zmax=1.0,
        colorscale=PROBABILITY_COLORSCALE,
        colorbar={"title": {"text": "p"}, "thickness": 12},
        text=labels,
        texttemplate="%{text}",
        textfont={"size": 10},
        customdata=hovers,
        hovertemplate="%{customdata}<extra></extra>",
        xgap=1,
        ygap=1,
        name="top-k",
    )
    fig = go.Figure([heatmap, _chosen_markers(tokens, xs)], layout=base_layout(TITLE, height=height))
    fig.update_xaxes(title_text="step", showgrid=False, zeroline=False)
    fig.update_yaxes(title_text="rank", autorange="reversed", dtick=1, showgrid=False, zeroline=False)
    fig.update_layout(showlegend=False)
    return fig
