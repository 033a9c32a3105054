"""`StrategyView`: what the lab draws for one strategy. Every visualizer module registers its strategies' views
the same way, by defining `VIEWS: dict[str, StrategyView]`; `visualizers/__init__.py` collects them
(docs/architecture.md section 8). This module registers the baseline view (greedy, sample), which is also the
view of a strategy that registers none."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from lab.trace import Event
from visualizers.inspect import step_alternatives_figure
from visualizers.topk import topk_figure

FigureFn = Callable[[list[Event]], go.Figure]


@dataclass(frozen=True)
class StrategyView:
    """What the lab draws for a strategy: figures (main view first) and token-view highlights."""

    figures: tuple[FigureFn, ...]
    highlight_steps: Callable[[list[Event]], set[int]] | None = None
    highlight_label: str = ""
    # (events, step, **knobs) -> figure of one step; knobs the strategy understands (e.g. gamma for CFG)
    inspect: Callable[..., go.Figure] = step_alternatives_figure
    knobs: tuple[str, ...] = ()


BASELINE_VIEW = StrategyView(figures=(topk_figure,))

VIEWS = {"greedy": BASELINE_VIEW, "sample": BASELINE_VIEW}
