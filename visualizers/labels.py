"""Labels that fit: which point labels of a figure can be written without overlapping (the rest are left to hover).

Covers: the pixel geometry of a figure whose height we set and whose width follows the page (`PlotBox`: the plot
area from the figure height, the margins and an assumed minimum width, and the data ranges it maps), an estimate of
a label's drawn size (`text_size`), and `fit_labels`, which keeps labels greedily in priority order and drops any
whose box would overlap a kept label or another point's marker, after shortening long ones to the room they have.
Rows of trees are spaced so that labels of one level never collide (`tree_height`), and heatmap cells get their
token written only when the cell is big enough for it (`cell_text`). The width is a lower bound: a wider page only
spreads the points apart, so labels that fit at the assumed width fit wider too.
Not covered: measuring fonts (widths are estimated per character; wide CJK characters count double).
"""

from __future__ import annotations

import html
import unicodedata
from dataclasses import dataclass

from visualizers.style import ZWNJ, distinct_labels

NARROW_PLOT_PX = 420  # plot-area width of a main figure beside the token view at 1280 px (margins excluded)
WIDE_PLOT_PX = 900  # the inspector's full-width figures
LABEL_FONT = 11
ROW_PX = 24  # vertical room per leaf of a tree: an 11 px label plus a gap
ELLIPSIS = "…"


@dataclass(frozen=True)
class PlotBox:
    """Maps data coordinates to pixels of the plot area (y grows upwards in data, downwards on screen)."""

    width: float
    height: float
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def px(self, x: float, y: float) -> tuple[float, float]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        return (x - x0) / (x1 - x0) * self.width, (y1 - y) / (y1 - y0) * self.height


def char_px(ch: str, font: float) -> float:
    return font * (1.15 if unicodedata.east_asian_width(ch) in "WF" else 0.62)


def text_size(text: str, font: float = LABEL_FONT) -> tuple[float, float]:
    """(width, height) in px of one line of text at `font` px (an estimate on the generous side); HTML entities
    (plotly draws &lt; as <) count as the character they stand for, zero-width characters as nothing."""
    drawn = html.unescape(text).replace(ZWNJ, "")
    return sum(char_px(ch, font) for ch in drawn) + 2, font * 1.3


def shorten(text: str, room_px: float, font: float = LABEL_FONT) -> str:
    """The text cut (with an ellipsis) to fit `room_px`; "" when not even one character and the ellipsis fit."""
    if text_size(text, font)[0] <= room_px:
        return text
    for end in range(len(text) - 1, 0, -1):
        amp = text.rfind("&", 0, end)
        if amp >= 0 and ";" not in text[amp:end]:
            continue  # never cut inside an HTML entity (&lt; ...)
        cut = text[:end] + ELLIPSIS
        if text_size(cut, font)[0] <= room_px:
            return cut
    return ""


def _box(x: float, y: float, w: float, h: float, anchor: str, offset: float) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a label drawn at the pixel point (x, y)."""
    if anchor == "right":
        return x + offset, y - h / 2, x + offset + w, y + h / 2
    if anchor == "left":
        return x - offset - w, y - h / 2, x - offset, y + h / 2
    if anchor == "top":
        return x - w / 2, y - offset - h, x + w / 2, y - offset
    return x - w / 2, y - h / 2, x + w / 2, y + h / 2


def _overlap(a: tuple, b: tuple, gap: float = 1.0) -> bool:
    return a[0] < b[2] + gap and b[0] < a[2] + gap and a[1] < b[3] + gap and b[1] < a[3] + gap


def fit_labels(
    points: list[tuple[float, float]],
    labels: list[str],
    box: PlotBox,
    *,
    anchor: str | list[str] = "right",
    marker_px: float = 13,
    priority: list[float] | None = None,
    max_px: float | None = None,
    font: float = LABEL_FONT,
) -> list[str]:
    """Per point, its label (maybe shortened) or "" when it would overlap a label already kept or another point's
    marker. Points are tried in decreasing `priority` (default: in order); `max_px` caps a label's width; `anchor`
    (one for all or one per point): right, left, top or center of the point."""
    pixels = [box.px(x, y) for x, y in points]
    half = marker_px / 2
    markers = [(x - half, y - half, x + half, y + half) for x, y in pixels]
    anchors = anchor if isinstance(anchor, list) else [anchor] * len(points)
    order = sorted(range(len(points)), key=lambda i: -(priority[i] if priority else -i))
    kept: list[tuple] = []
    out = [""] * len(points)
    for i in order:
        x, y = pixels[i]
        where = anchors[i]
        offset = half + 2 if where != "center" else 0
        room = max_px if max_px is not None else box.width
        if where == "right":
            room = min(room, box.width - x - offset)
        elif where == "left":
            room = min(room, x - offset)
        text = shorten(labels[i], room, font)
        if not text:
            continue
        w, h = text_size(text, font)
        rect = _box(x, y, w, h, where, offset)
        # a centred label sits on its own cell; others must keep clear of every other point's marker
        hits_marker = where != "center" and any(_overlap(rect, m, 0) for j, m in enumerate(markers) if j != i)
        if hits_marker or any(_overlap(rect, k) for k in kept):
            continue
        kept.append(rect)
        out[i] = text
    return out


def tree_height(rows: int, minimum: int = 320, margins: int = 110) -> int:
    """A tree figure's height: ROW_PX per leaf row (its widest level), at least `minimum`."""
    return max(minimum, margins + ROW_PX * max(1, rows))


def cell_text(labels: list[list[str]], cols: int, rows: int, width_px: float, height_px: float, font: float = 10):
    """Heatmap cell texts: each label shortened to its cell, or all "" when the cells are too small to read
    (narrower than three characters or lower than the font); hover keeps the full text either way."""
    cell_w, cell_h = width_px / max(1, cols), height_px / max(1, rows)
    if cell_w < text_size("abc", font)[0] or cell_h < font + 4:
        return [["" for _ in row] for row in labels]
    short = [[shorten(label.replace(ZWNJ, ""), cell_w - 4, font) for label in row] for row in labels]
    flat = distinct_labels([label for row in short for label in row])  # repeated tokens stay distinct
    width = len(short[0]) if short else 0
    return [flat[r * width : (r + 1) * width] for r in range(len(short))]
