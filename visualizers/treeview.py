"""Tree figures that scale: collapsed branches, a layered layout, a height from the widest level, labels that fit.

Covers: `collapse(parents, depths, keep)` (the kept nodes, which must include every kept node's ancestors, and one
summary per kept node or the root for the hidden branches below it, counting every hidden descendant), `TreeLayout`
(x = depth, y = leaf order with parents centred over their children, from `layered_y`, for
the kept nodes and the summaries together; `height` grows with the number of leaf rows; `labels` keeps only the
labels that fit beside their node at the assumed plot width, `visualizers.labels`), and `apply_frame` (axes with
fixed ranges so the pixel geometry the labels were fitted for is the one drawn, a bottom legend, uirevision).
Imports plotly, the standard library and visualizers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from visualizers.labels import NARROW_PLOT_PX, PlotBox, fit_labels, tree_height

MARGIN = {"l": 24, "r": 24, "t": 48, "b": 72}
X_PAD = 0.5


def collapse(parents: list[int], depths: list[int], keep: set[int]) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """(kept nodes in order, [(anchor, hidden nodes)]): each hidden node hangs from its nearest kept ancestor (or
    the root, -1); one group per anchor, in the order anchors appear."""
    anchor_of: dict[int, int] = {}
    for i in sorted(range(len(parents)), key=lambda n: depths[n]):
        if i in keep:
            continue
        p = parents[i]
        anchor_of[i] = p if p < 0 or p in keep else anchor_of.get(p, -1)
    groups: dict[int, list[int]] = {}
    for i in sorted(anchor_of):
        groups.setdefault(anchor_of[i], []).append(i)
    shown = [i for i in range(len(parents)) if i in keep]
    return shown, sorted(groups.items(), key=lambda item: item[0])


def layered_y(parents: list[int]) -> list[float]:
    """y of each node (leaves in depth-first order, parents centred over their children); the last entry is the
    root's y."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    y: dict[int, float] = {}
    next_leaf = 0.0

    def place(node: int) -> float:
        nonlocal next_leaf
        kids = children.get(node, [])
        if not kids:
            y[node], next_leaf = next_leaf, next_leaf + 1
        else:
            spots = [place(kid) for kid in kids]
            y[node] = (spots[0] + spots[-1]) / 2
        return y[node]

    place(-1)
    return [-y[i] for i in range(len(parents))] + [-y[-1]]


@dataclass
class TreeLayout:
    """Positions of the shown nodes (original indices) and of the collapsed summaries, and the figure's size."""

    shown: list[int]
    groups: list[tuple[int, list[int]]]
    x: dict  # key: node index, ("group", g) or "root" -> depth coordinate
    y: dict
    height: int
    max_x: float
    bottom: int = MARGIN["b"]  # bottom margin: axis title and legend (more under a slider)

    def make_room(self, bottom: int) -> None:
        """A larger bottom margin, the plot area's height unchanged (call before fitting labels)."""
        self.height += bottom - self.bottom
        self.bottom = bottom

    @classmethod
    def build(cls, parents: list[int], depths: list[int], keep: set[int], root_x: float = -1.0) -> TreeLayout:

        shown, groups = collapse(parents, depths, keep)
        index = {node: k for k, node in enumerate(shown)}
        layout_parents = [index.get(parents[i], -1) for i in shown]
        layout_parents += [index.get(anchor, -1) for anchor, _ in groups]
        ys = layered_y(layout_parents)
        x: dict = {"root": root_x}
        y: dict = {"root": ys[-1]}
        for k, node in enumerate(shown):
            x[node], y[node] = float(depths[node]), ys[k]
        for g, (anchor, _hidden) in enumerate(groups):
            x[("group", g)] = (depths[anchor] + 1.0) if anchor >= 0 else root_x + 1.0
            y[("group", g)] = ys[len(shown) + g]
        rows = int(round(max(ys) - min(ys))) + 1 if ys else 1
        max_x = max(x.values())
        return cls(shown, groups, x, y, tree_height(rows), max_x)

    def box(self, extra_x: float = 1.0, width: float = NARROW_PLOT_PX) -> PlotBox:
        ys = list(self.y.values())
        plot_h = self.height - MARGIN["t"] - self.bottom
        return PlotBox(width, plot_h, self.x_range(extra_x), (min(ys) - 0.6, max(ys) + 0.6))

    def x_range(self, extra_x: float = 1.0) -> tuple[float, float]:
        return self.x["root"] - X_PAD, self.max_x + extra_x + 0.9  # room for the last level's labels

    def labels(self, keys: list, texts: list[str], priority: list[float], extra_x: float = 1.0, width=None) -> dict:
        """{key: label or ""} for the given node keys, fitted at the assumed plot width: right of each node and no
        wider than the gap to the next level; the root's to its left."""
        box = self.box(extra_x, width or NARROW_PLOT_PX)
        points = [(self.x[k], self.y[k]) for k in keys]
        column_px = box.width / (box.x_range[1] - box.x_range[0])
        anchors = ["left" if k == "root" else "right" for k in keys]
        fitted = fit_labels(points, texts, box, anchor=anchors, priority=priority, max_px=column_px - 22)
        return dict(zip(keys, fitted, strict=True))


def apply_frame(fig: go.Figure, layout: TreeLayout, extra_x: float = 1.0) -> go.Figure:
    """Fixed axis ranges (the geometry the labels were fitted for), hidden y axis, bottom legend, the height."""
    box = layout.box(extra_x)
    margin = {**MARGIN, "b": layout.bottom}
    fig.update_layout(height=layout.height, margin=margin, legend={"orientation": "h", "y": -0.02, "yanchor": "top"})
    fig.update_xaxes(range=list(box.x_range), zeroline=False, showgrid=False, fixedrange=False)
    fig.update_yaxes(visible=False, range=list(box.y_range))
    return fig
