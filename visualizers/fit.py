"""Fitting a finished figure's text to the space it is drawn in, applied to every strategy figure in one place.

Covered: `fit_figure(fig, width_px)`: axes grow their margins to hold their tick labels (plotly's automargin, so a
long category label is never cut at the figure's edge); a horizontal legend sits in its own row between the title and
the plot (room made for it; above subplot titles) instead of over an axis title, a subplot title or a heatmap's colour
bar; a title longer than the width wraps onto as many lines as it needs (room made for them), anchored to the top of
the figure; category tick labels that would crowd are written upright, and only every k-th where even that does not
fit. Not covered: text inside heatmap cells (`visualizers.labels.cell_text` decides that per figure).
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
TICK_CHAR_PX = 7.0  # a 12 px tick label's widest mean character width (token glyphs such as ␣ and ⏎ included)
TICK_LINE_PX = 16  # an upright tick label's width, and a y tick label's height, with a gap
CATEGORY_FILL = 0.85  # share of the axis length the categories get (margins the automargin takes are unknown here)


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


def _axis_categories(fig: go.Figure, letter: str) -> dict[str, list[str]]:
    """Layout axis name ("xaxis", "xaxis2", ...) -> its category labels in order, for axes that traces fill with
    text values (tokens, names); numeric axes are left out."""
    found: dict[str, list[str]] = {}
    for trace in fig.data:
        values = getattr(trace, letter, None)
        if values is None or trace.type == "table" or not len(values):
            continue
        if not all(isinstance(v, str) for v in values):
            continue
        anchor = getattr(trace, f"{letter}axis", None) or letter
        name = f"{letter}axis{anchor[1:]}"
        labels = found.setdefault(name, [])
        labels += [v for v in values if v not in labels]
    return found


def _tick_labels(fig: go.Figure, letter: str) -> dict[str, tuple[list, list[str]]]:
    """Layout axis name -> (tick values, their labels) of the axes that label ticks with text: category axes, and
    axes whose figure gave its own tick values and texts (tokens at numeric positions)."""
    found = {name: (labels, labels) for name, labels in _axis_categories(fig, letter).items()}
    for name in fig.layout.to_plotly_json():
        axis = fig.layout[name] if re.fullmatch(f"{letter}axis\\d*", name) else None
        if axis is not None and axis.tickvals is not None and axis.ticktext is not None:
            found[name] = (list(axis.tickvals), [str(t) for t in axis.ticktext])
    return found


def _fit_categories(fig: go.Figure, width: float, plot_height: float) -> None:
    """Text tick labels that never crowd: a dense x axis writes its labels upright (-90 degrees; the margin grows
    to hold them) and, where even upright labels do not fit, only every k-th; a dense y axis likewise shows every
    k-th."""
    for letter, length in (("x", width - 90), ("y", plot_height)):
        for name, (values, labels) in _tick_labels(fig, letter).items():
            axis = fig.layout[name]
            if not labels or axis.type not in (None, "category", "-", "linear"):
                continue
            domain = axis.domain or (0, 1)
            slot = max(length * (domain[1] - domain[0]), 40) * CATEGORY_FILL / len(labels)
            lines = [line for label in labels for line in label.split("<br>")]
            along = max(map(_plain_length, lines)) * TICK_CHAR_PX if letter == "x" else TICK_LINE_PX
            if along <= slot:
                continue
            update = {"tickangle": -90} if letter == "x" else {}
            if slot < TICK_LINE_PX:  # upright labels still overlap: label every k-th one
                every = math.ceil(TICK_LINE_PX / slot)
                update |= {"tickmode": "array", "tickvals": values[::every], "ticktext": labels[::every]}
            axis.update(update)


def fit_figure(fig: go.Figure, width_px: float | None = None) -> go.Figure:
    """The same figure with its titles, legend and tick labels fitted to `width_px` (module docstring)."""
    width = width_px or DEFAULT_WIDTH_PX
    layout = fig.layout
    top, height = layout.margin.t if layout.margin.t is not None else 44, layout.height or 320
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    bottom = layout.margin.b if layout.margin.b is not None else 40
    _fit_categories(fig, width, height - top - bottom)
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
