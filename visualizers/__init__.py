"""Visualizers: pure functions from trace events to plotly figures and HTML token views (DESIGN.md section 8).

Covers: the token view (`token_view_html`, `alternatives_table`), the baseline top-k heatmap (`topk_figure`,
`empty_figure`) and `strategy_figure`, which picks a strategy's main figure by name through `FIGURES`
(greedy and sample use the top-k chart; unknown names fall back to it). Shared colours and layout live in
`visualizers.style`. This package imports plotly, the standard library and `lab.trace` only: never torch or
gradio (tests/test_boundaries.py enforces it). Not covered yet: the detail views of later strategies.
"""

from __future__ import annotations

from collections.abc import Callable

import plotly.graph_objects as go

from lab.trace import Event
from visualizers.style import STATUS_COLORS, TOKEN_BACKGROUNDS, base_layout, display_token, distinct_labels
from visualizers.tokens import alternatives_table, token_view_html
from visualizers.topk import empty_figure, topk_figure

FigureFn = Callable[[list[Event]], go.Figure]

FIGURES: dict[str, FigureFn] = {
    "greedy": topk_figure,
    "sample": topk_figure,
}


def strategy_figure(strategy_name: str, events: list[Event]) -> go.Figure:
    """The main live figure of a strategy, chosen by its name; unknown names get the top-k chart."""
    return FIGURES.get(strategy_name, topk_figure)(events)


__all__ = [
    "FIGURES",
    "STATUS_COLORS",
    "TOKEN_BACKGROUNDS",
    "alternatives_table",
    "base_layout",
    "display_token",
    "distinct_labels",
    "empty_figure",
    "strategy_figure",
    "token_view_html",
    "topk_figure",
]
