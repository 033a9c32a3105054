"""Visualizers: pure functions from trace events to plotly figures and HTML token views (docs/architecture.md section
8).

Covers: the token view (`token_view_html`, `alternatives_table`), the baseline top-k heatmap (`topk_figure`,
`empty_figure`) and the per-strategy view registry `VIEWS`: each strategy names the figures it draws (in order,
the first is its main live view) and optionally the steps the token view should highlight. Unknown strategies
fall back to the baseline view. Views are registered one way: every module of this package that defines
`VIEWS: dict[str, StrategyView]` (see `visualizers.view`) is collected here, so a new strategy's visualizer registers
itself. Shared colours and layout live in `visualizers.style`. This package imports
plotly, the standard library and `lab.trace` only: never torch or gradio (tests/test_boundaries.py enforces it).
"""

from __future__ import annotations

import importlib
import pkgutil
from inspect import signature

import plotly.graph_objects as go

from lab.trace import Event
from visualizers.fit import fit_figure
from visualizers.inspect import step_alternatives_figure
from visualizers.style import STATUS_COLORS, TOKEN_BACKGROUNDS, base_layout, display_token, distinct_labels
from visualizers.tokens import alternatives_table, token_view_html
from visualizers.topk import empty_figure, topk_figure
from visualizers.view import BASELINE_VIEW, StrategyView

VIEWS: dict[str, StrategyView] = {}


def _collect_module_views() -> None:
    """Merge the VIEWS of every visualizer module that defines one (modules register their own strategies)."""
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        views = getattr(module, "VIEWS", None)
        if isinstance(views, dict):
            VIEWS.update(views)


_collect_module_views()


def strategy_view(strategy_name: str) -> StrategyView:
    return VIEWS.get(strategy_name, BASELINE_VIEW)


def strategy_figures(strategy_name: str, events: list[Event], width_px: float | None = None) -> list[go.Figure]:
    """Every live figure of a strategy, main view first; `width_px` (the plot width a narrow column gives) goes to
    the figures that fit their text to it; every figure then goes through `visualizers.fit.fit_figure`."""
    figures = strategy_view(strategy_name).figures
    if width_px is None:
        return [fit_figure(figure(events)) for figure in figures]
    return [
        fit_figure(figure(events, width_px=width_px) if "width_px" in signature(figure).parameters else figure(events))
        for figure in figures
    ]


def strategy_figure(strategy_name: str, events: list[Event]) -> go.Figure:
    """The main live figure of a strategy, chosen by its name; unknown names get the top-k chart."""
    return strategy_view(strategy_name).figures[0](events)


def inspect_step(strategy_name: str, events: list[Event], step: int, **knobs: float) -> go.Figure:
    """The strategy's detail figure for one step; knobs it does not declare are dropped."""
    view = strategy_view(strategy_name)
    return view.inspect(events, step, **{k: v for k, v in knobs.items() if k in view.knobs})


def strategy_token_view(
    strategy_name: str, events: list[Event], selected_step: int | None = None, placeholder: str = ""
) -> str:
    """The token view with the strategy's highlighted steps (if it defines any); `placeholder`: what shows before
    the first token (default: visualizers.tokens.PLACEHOLDER)."""
    view = strategy_view(strategy_name)
    steps = view.highlight_steps(events) if view.highlight_steps else set()
    return token_view_html(events, selected_step, steps, view.highlight_label, placeholder)


__all__ = [
    "STATUS_COLORS",
    "TOKEN_BACKGROUNDS",
    "VIEWS",
    "StrategyView",
    "alternatives_table",
    "base_layout",
    "display_token",
    "distinct_labels",
    "empty_figure",
    "inspect_step",
    "step_alternatives_figure",
    "strategy_figure",
    "strategy_figures",
    "strategy_token_view",
    "token_view_html",
    "topk_figure",
]
