"""Fitting a finished figure's text to the space it is drawn in, applied to every strategy figure in one place.

Covered: `fit_figure(fig, width_px)`: axes grow their margins to hold their tick labels (plotly's automargin, so a
long category label is never cut at the figure's edge); a horizontal legend sits in its own row between the title and
the plot (room made for it) instead of over an axis title or a heatmap's colour bar; a title longer than the width
wraps onto a second line (room made for it), anchored to the top of the figure. Not covered: tick labels that crowd
each other inside a dense categorical axis, and text inside heatmap cells (`visualizers.labels.cell_text` decides that
per figure).
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
    """Each line of the title (lines split at <br>) on at most two lines, broken at a space (or a separator) before
    `limit` characters."""
    if "<br>" in text:
        return "<br>".join(_wrap(line, limit) for line in text.split("<br>"))
    if _plain_length(text) <= limit:
        return text
    cut = max(text.rfind(sep, 0, limit) for sep in (" ", ":", ",", "·"))
    if cut <= limit // 3:
        cut = limit
    return text[:cut].rstrip() + "<br>" + text[cut:].lstrip()


def _plain_length(text: str) -> int:
    return len(re.sub(r"<[^>]+>", "", text))


def _legend_rows(fig: go.Figure, width: float) -> int:
    """Rows a horizontal legend of the figure's named traces takes at `width` (items wrap)."""
    names = [t.name for t in fig.data if t.name and t.showlegend is not False]
    used = sum(LEGEND_ITEM_PX + LEGEND_CHAR_PX * _plain_length(n) for n in names)
    return max(1, math.ceil(used / max(width - 60, 100)))


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
        fig.update_layout(legend={"y": 1.0, "yanchor": "bottom", "x": 0, "xanchor": "left"})
        rows = _legend_rows(fig, width)
        top, height = top + rows * LEGEND_ROW_PX, height + rows * LEGEND_ROW_PX
    if title and (wrapped or layout.legend.orientation == "h"):
        # its first line TITLE_TOP_PX under the figure's top edge (plotly ignores the pad here), clear of the legend
        top, height = top + TITLE_TOP_PX // 2, height + TITLE_TOP_PX // 2
        fig.update_layout(title={"yref": "container", "y": 1.0 - TITLE_TOP_PX / height, "yanchor": "top"})
    fig.update_layout(margin_t=top, height=height)
    return fig
