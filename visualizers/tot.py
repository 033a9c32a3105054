"""Tree of Thoughts live views (Yao et al. 2023), drawn from ThoughtNode / ThoughtStep / ThoughtResult events.

Covers three figures, each with an empty state before the first node:
- `tree_figure`: the search tree as a node-link scatter with a layered layout (x = depth, y = leaf order, a
  parent centred over its children), one trace per status (kept / pruned / solution, plus the root) so the
  legend toggles them, the final path drawn over the edges once the search has answered, hover text with the
  thought, its value and where the value came from (model verdict, votes, solver, exact check), the solver's
  verdict and the proposal log-probability; the title carries the model calls and tokens so far;
- `frontier_figure`: every candidate's value per step (x = step, one trace per status), the frontier kept at
  each step outlined, and the frontier size per step on a second axis;
- `counters_figure`: cumulative model calls and tokens after each step, and (Game of 24 with model values)
  how often the model's verdict agreed with the exact solver;
- `thought_inspect(events, step)` (the app's step inspector): the thought of the final path that holds answer
  token `step`, with the values of its sibling candidates.
Draws only what the trace recorded. Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

import textwrap

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.trace import (
    Event,
    ThoughtNode,
    ThoughtResult,
    ThoughtStep,
    TokenEmitted,
    search_counters,
    verdict_agreement,
)
from visualizers.style import STATUS_COLORS, base_layout, plot_text
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

PLACEHOLDER = "No thoughts yet"
STATUSES = ("kept", "pruned", "solution")
COLORS = {
    "root": STATUS_COLORS["target"],
    "kept": STATUS_COLORS["accepted"],
    "pruned": STATUS_COLORS["pruned"],
    "solution": STATUS_COLORS["bonus"],
}
PATH_COLOR = STATUS_COLORS["recovered"]
MAX_LABEL = 28


def _nodes(events: list[Event]) -> dict[int, ThoughtNode]:
    return {e.node_id: e for e in events if isinstance(e, ThoughtNode)}


def _result(events: list[Event]) -> ThoughtResult | None:
    return next((e for e in reversed(events) if isinstance(e, ThoughtResult)), None)


def layered_layout(nodes: dict[int, ThoughtNode]) -> dict[int, tuple[int, float]]:
    """(x, y) per node: x = depth, leaves numbered top to bottom in depth-first order, parents centred."""
    children: dict[int, list[int]] = {}
    for node in nodes.values():
        children.setdefault(node.parent, []).append(node.node_id)
    positions: dict[int, tuple[int, float]] = {}
    next_leaf = 0.0
    roots = [i for i, n in nodes.items() if n.parent not in nodes]
    stack: list[tuple[int, bool]] = [(r, False) for r in reversed(sorted(roots))]
    while stack:  # iterative post-order, so deep trees never hit the recursion limit
        node_id, visited = stack.pop()
        kids = sorted(children.get(node_id, []))
        if not kids:
            positions[node_id], next_leaf = (nodes[node_id].depth, -next_leaf), next_leaf + 1
        elif visited:
            ys = [positions[k][1] for k in kids]
            positions[node_id] = (nodes[node_id].depth, (min(ys) + max(ys)) / 2)
        else:
            stack.append((node_id, True))
            stack.extend((k, False) for k in reversed(kids))
    return positions


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _hover(node: ThoughtNode) -> str:
    text = "<br>".join(plot_text(line) for line in textwrap.wrap(node.text, 60)[:12]) or "∅"
    parts = [f"<b>node {node.node_id}</b> · depth {node.depth} · step {node.step} · {node.status}", text]
    if node.value is not None:
        detail = f"V = {_fmt(node.value)} ({node.value_source}"
        detail += f", verdict {node.judgment})" if node.judgment else ")"
        parts.append(detail)
    if node.solver_value is not None:
        parts.append("solver: " + ("still solvable" if node.solver_value == 1.0 else "cannot reach 24"))
    if node.logprob is not None:
        parts.append(f"log p(thought | legal) = {node.logprob:.2f}")
    parts.append(f"model calls {node.model_calls} · tokens {node.tokens:,}")
    return "<br>".join(parts)


def _label(text: str) -> str:
    first = text.splitlines()[0] if text else ""
    first = first.split(" (left:")[0]
    return plot_text(first if len(first) <= MAX_LABEL else first[: MAX_LABEL - 1] + "…")


def _edges(nodes: dict[int, ThoughtNode], pos: dict[int, tuple[int, float]]) -> go.Scatter:
    edge_x: list[float | None] = []
    edge_y: list[float | None] = []
    for node in nodes.values():
        if node.parent in pos:
            (x0, y0), (x1, y1) = pos[node.parent], pos[node.node_id]
            edge_x += [x0, x1, None]
            edge_y += [y0, y1, None]
    line = {"color": "#cbd5e1", "width": 1}
    return go.Scatter(x=edge_x, y=edge_y, mode="lines", line=line, hoverinfo="skip", showlegend=False)


def _status_trace(
    status: str, group: list[ThoughtNode], pos: dict[int, tuple[int, float]], on_path: set[int]
) -> go.Scatter:
    """The markers of one status; nodes on the final path are larger, outlined and labelled."""
    marked = [n.node_id in on_path for n in group]
    marker = {
        "color": COLORS[status],
        "size": [13 if m else 9 for m in marked],
        "line": {"color": [PATH_COLOR if m else "white" for m in marked], "width": 2},
    }
    return go.Scatter(
        x=[pos[n.node_id][0] for n in group],
        y=[pos[n.node_id][1] for n in group],
        mode="markers+text",
        name=status,
        text=[_label(n.text) if m or n.status == "solution" else "" for n, m in zip(group, marked, strict=True)],
        textposition="top center",
        marker=marker,
        hovertext=[_hover(n) for n in group],
        hoverinfo="text",
    )


def tree_figure(events: list[Event]) -> go.Figure:
    """The search tree: layered node-link scatter, one trace per status, the final path highlighted."""
    nodes = _nodes(events)
    if not nodes:
        return empty_figure("Tree of Thoughts: search tree", PLACEHOLDER)
    pos = layered_layout(nodes)
    calls, tokens = search_counters(events)
    leaves = len({y for _, y in pos.values()})
    title = f"Search tree · {len(nodes)} thoughts · {calls} model calls · {tokens:,} tokens"
    fig = go.Figure(layout=base_layout(title, max(320, min(900, 14 * leaves + 120))))
    fig.add_trace(_edges(nodes, pos))
    result = _result(events)
    on_path = set(result.path) if result else set()
    if result and len(result.path) > 1:
        xs, ys = zip(*(pos[i] for i in result.path if i in pos), strict=True)
        line = {"color": PATH_COLOR, "width": 4}
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="final path", line=line, hoverinfo="skip"))
    groups = {"root": [n for n in nodes.values() if n.parent < 0]}
    groups.update({s: [n for n in nodes.values() if n.parent >= 0 and n.status == s] for s in STATUSES})
    for status, group in groups.items():
        if group:
            fig.add_trace(_status_trace(status, group, pos, on_path))
    depth = max(n.depth for n in nodes.values())
    fig.update_xaxes(title="depth (thought step)", dtick=1, range=[-0.4, depth + 0.6], zeroline=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(legend={"orientation": "h", "y": -0.12})
    return fig


def frontier_figure(events: list[Event]) -> go.Figure:
    """Candidate values per step by status, the kept frontier outlined, the frontier size on a second axis."""
    nodes = [n for n in _nodes(events).values() if n.parent >= 0]
    if not nodes:
        return empty_figure("Frontier per step", PLACEHOLDER)
    steps = [e for e in events if isinstance(e, ThoughtStep)]
    frontier = {i for s in steps for i in s.frontier}
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(base_layout("Candidates per step: value V(s), frontier outlined", 300))
    for status in STATUSES:
        group = [n for n in nodes if n.status == status]
        if not group:
            continue
        outline = ["#0f172a" if n.node_id in frontier else "white" for n in group]
        marker = {"color": COLORS[status], "size": 9, "opacity": 0.8, "line": {"color": outline, "width": 1.5}}
        values = [n.value if n.value is not None else 0.0 for n in group]
        hover = [_hover(n) for n in group]
        fig.add_trace(
            go.Scatter(
                x=[n.step for n in group],
                y=values,
                mode="markers",
                name=status,
                marker=marker,
                hovertext=hover,
                hoverinfo="text",
            )
        )
    if steps:
        size = go.Scatter(
            x=[s.step for s in steps],
            y=[len(s.frontier) for s in steps],
            mode="lines+markers",
            name="frontier size",
            line={"color": "#64748b", "dash": "dot"},
            hovertemplate="step %{x}: %{y} states in the frontier<extra></extra>",
        )
        fig.add_trace(size, secondary_y=True)
    fig.update_xaxes(title="step", dtick=1)
    fig.update_yaxes(title="value V(s)", secondary_y=False)
    fig.update_yaxes(title="frontier size", secondary_y=True, showgrid=False, rangemode="tozero")
    return fig


def agreement(events: list[Event]) -> tuple[int, int]:
    """(agree, compared): `lab.trace.verdict_agreement` over the thoughts emitted so far (the eval's definition)."""
    return verdict_agreement(_nodes(events).values())


def counters_figure(events: list[Event]) -> go.Figure:
    """Cumulative model calls and tokens per step; the model-vs-solver agreement in the title when measured."""
    steps = [e for e in events if isinstance(e, ThoughtStep)]
    if not steps:
        return empty_figure("Model calls and tokens", PLACEHOLDER)
    agree, compared = agreement(events)
    title = "Model calls and tokens per step"
    if compared:
        title += f" · model verdict agrees with the solver on {agree}/{compared} thoughts"
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(base_layout(title, 260))
    xs = [s.step if s.search == "bfs" else i + 1 for i, s in enumerate(steps)]
    calls = go.Scatter(x=xs, y=[s.model_calls for s in steps], name="model calls", mode="lines+markers")
    tokens = go.Scatter(x=xs, y=[s.tokens for s in steps], name="tokens", mode="lines+markers")
    fig.add_trace(calls.update(line={"color": STATUS_COLORS["bonus"]}))
    fig.add_trace(tokens.update(line={"color": STATUS_COLORS["recovered"]}), secondary_y=True)
    fig.update_xaxes(title="step" if steps[0].search == "bfs" else "expansion", dtick=1)
    fig.update_yaxes(title="model calls", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title="tokens", secondary_y=True, showgrid=False, rangemode="tozero")
    return fig


def thought_inspect(events: list[Event], step: int, **_knobs: float) -> go.Figure:
    """The step inspector: the answer line holding token `step` is one thought of the final path; draw the
    values of that thought and its siblings (the k candidates generated from the same state), by status."""
    result = _result(events)
    tokens = [e for e in events if isinstance(e, TokenEmitted) and e.step <= step]
    title = f"Candidates for the thought holding token {step}"
    if result is None or not tokens or tokens[-1].step != step:
        return empty_figure(title, "No answer yet")
    line = "".join(e.text for e in tokens[:-1]).count("\n")
    nodes = _nodes(events)
    if line + 1 >= len(result.path):
        return empty_figure(title, "This token is not part of a thought (e.g. the Answer line)")
    chosen = nodes[result.path[line + 1]]
    siblings = sorted((n for n in nodes.values() if n.parent == chosen.parent), key=lambda n: -(n.value or 0.0))
    outline = [PATH_COLOR if n is chosen else "white" for n in siblings]
    fig = go.Figure(layout=base_layout(f"Step {chosen.depth}: the {len(siblings)} candidates from one state", 360))
    fig.add_trace(
        go.Bar(
            x=[n.value or 0.0 for n in siblings],
            y=[f"{_label(n.text)} #{n.node_id}" for n in siblings],
            orientation="h",
            marker={"color": [COLORS[n.status] for n in siblings], "line": {"color": outline, "width": 3}},
            hovertext=[_hover(n) for n in siblings],
            hoverinfo="text",
        )
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title="value V(s)")
    return fig


VIEWS = {"tot": StrategyView(figures=(tree_figure, frontier_figure, counters_figure), inspect=thought_inspect)}
