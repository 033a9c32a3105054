"""Fitting a finished figure's text to the space it is drawn in, applied to every strategy figure in one place.

Covered: `fit_figure(fig, width_px)`: axes grow their margins to hold their tick labels (plotly's automargin, so a
long category label is never cut at the figure's edge); a horizontal legend sits in its own row between the title and
the plot (room made for it; above subplot titles) instead of over an axis title, a subplot title or a heatmap's colour
bar; a title longer than the width wraps onto as many lines as it needs (room made for them), anchored to the top of
the figure. Not covered: tick labels that crowd each other inside a dense categorical axis, and text inside heatmap
cells (`visualizers.labels.cell_text` decides that per figure).
"""

from __future__ import annotations

import math
import re

import plotly.graph_objects as go

TITLE_CHAR_PX = 7.4  # a 14 px title's mean character width
LINE_PX = 20
LEGEND_ROW_PX = 26
TITLE_TOP_PX = 32
LEGEND_ITEM_PX = 46  # a legend item's symbol and gaps
LEGEND_CHAR_PX = 6.6
DEFAULT_WIDTH_PX = 440  # the narrowest plot slot of the app's layout


def _wrap(text: str, limit: int) -> str:
    """Each line of the title (lines split at <br>) on as many lines as it needs, each broken at a space (or a
    separator) before `limit` characters."""
    limit = max(limit, 12)
    if "<br>" in text:
        return "<br>".join(_wrap(line, limit) for line in text.split("<br>"))
    if _plain_length(text) <= limit:
        return text
    cut = max(text.rfind(sep, 0, limit) for sep in (" ", ":", ",", "·"))
    if cut <= limit // 3:
        cut = limit
    return text[:cut].rstrip() + "<br>" + _wrap(text[cut:].lstrip(), limit)


def _plain_length(text: str) -> int:
    return len(re.sub(r"<[^>]+>", "", text))


def _legend_rows(fig: go.Figure, width: float) -> int:
    """Rows a horizontal legend of the figure's named traces takes at `width` (items wrap)."""
    names = [t.name for t in fig.data if t.name and t.showlegend is not False]
    used = sum(LEGEND_ITEM_PX + LEGEND_CHAR_PX * _plain_length(n) for n in names)
    return max(1, math.ceil(used / max(width - 60, 100)))


def _top_annotations(fig: go.Figure) -> bool:
    """Whether text sits on the plot's top edge (make_subplots' subplot titles: paper y 1, anchored at the bottom)."""
    return any(a.yref == "paper" and (a.y or 0) >= 1.0 and a.yanchor == "bottom" for a in fig.layout.annotations)


def fit_figure(fig: go.Figure, width_px: float | None = None) -> go.Figure:
    """The same figure with its titles, legend and tick labels fitted to `width_px` (module docstring)."""
    width = width_px or DEFAULT_WIDTH_PX
    layout = fig.layout
    top, height = layout.margin.t if layout.margin.t is not None else 44, layout.height or 320
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    title = layout.title.text or ""
    limit = int((width - 30) / TITLE_CHAR_PX)
    fitted = _wrap(title, limit)
    added = fitted.count("<br>") - title.count("<br>")  # lines the wrapping added
    wrapped = added > 0
    if wrapped:
        fig.update_layout(title_text=fitted)
        top, height = top + added * LINE_PX, height + added * LINE_PX
    if any(t.type == "heatmap" and t.showlegend for t in fig.data):  # a side legend would cover the colour bar
        fig.update_layout(legend_orientation="h")
    if layout.legend.orientation == "h":  # legend rows between the title and the plot, never on an axis
        # above the subplot titles, which sit on the plot's top edge (every change here keeps the plot's height)
        lift = LINE_PX if _top_annotations(fig) else 0
        plot_px = max(height - top - (layout.margin.b if layout.margin.b is not None else 40), 40)
        fig.update_layout(legend={"y": 1.0 + lift / plot_px, "yanchor": "bottom", "x": 0, "xanchor": "left"})
        rows = _legend_rows(fig, width)
        top, height = top + rows * LEGEND_ROW_PX + lift, height + rows * LEGEND_ROW_PX + lift
    if title and (wrapped or layout.legend.orientation == "h"):
        # its first line TITLE_TOP_PX under the figure's top edge (plotly ignores the pad here), clear of the legend
        top, height = top + TITLE_TOP_PX // 2, height + TITLE_TOP_PX // 2
        fig.update_layout(title={"yref": "container", "y": 1.0 - TITLE_TOP_PX / height, "yanchor": "top"})
    fig.update_layout(margin_t=top, height=height)
    return fig
