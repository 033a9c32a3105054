"""EAGLE-2's live views (Li et al. 2024), drawn from `EagleDraft` and `TreeRound` events.

Covers four figures, each with an empty state before the first round:
- `growth_figure(events, step)`: one round's draft tree (default the latest) as a layered node-link plot
  (x = depth, root on the left, parents centred over their children). A slider replays the round: the tree
  growing depth by depth (nodes coloured by their cumulative score c(x) = sum of log q, expanded frontier
  nodes outlined), then the rerank cut (kept vs cut by c(x)), then verification (accepted path, verified but
  not accepted, cut, and the target's next token: recovered or bonus). Hover: token, depth, c(x), q, rank, p;
- `rerank_figure(events, step)`: every candidate's c(x) against its depth, with the rerank threshold (the
  lowest kept c(x)) as a line: what EAGLE-2's reranking keeps and cuts;
- `calibration_figure`: the draft's confidence against realised acceptance over every round so far (the
  premise of EAGLE-2, Sec. 3: confidence approximates acceptance). Binned exp(c(x)) (cumulative confidence) vs
  the share of those nodes on the accepted path, and q(x | parent) vs the share accepted among nodes whose
  parent was accepted (conditional acceptance), with the diagonal and counts in the hover;
- `tau_figure`: tokens per round (accepted + the target's token) and its running mean tau, with the tree size.
The token view colours tokens by provenance: accepted = the draft guessed it, recovered / bonus / target =
the target's own token. Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from lab.trace import EagleDraft, Event, TreeRound
from visualizers.labels import LABEL_FONT, WIDE_PLOT_PX
from visualizers.style import PROBABILITY_COLORSCALE, STATUS_COLORS, base_layout, display_token
from visualizers.topk import empty_figure
from visualizers.treeview import TreeLayout, apply_frame
from visualizers.view import StrategyView

PLACEHOLDER = "No EAGLE rounds yet"
SLIDER_MARGIN = 200  # px under the tree: axis title, the phase slider and its labels, the legend
BINS = 10
CUT = "cut by rerank"
VERIFIED = "verified, not accepted"
PHASE_COLORS = {"accepted": STATUS_COLORS["accepted"], VERIFIED: STATUS_COLORS["rejected"], CUT: "#cbd5e1"}


def _shown(text: str) -> str:
    return html.escape(display_token(text, escape=False), quote=False)


def _rounds(events: list[Event]) -> list[tuple[EagleDraft, TreeRound | None]]:
    """(EagleDraft, the TreeRound of the same step) per round, in order."""
    trees = {e.step: e for e in events if isinstance(e, TreeRound) and e.method == "eagle"}
    return [(e, trees.get(e.step)) for e in events if isinstance(e, EagleDraft)]


def _pick(events: list[Event], step: int | None) -> tuple[EagleDraft, TreeRound | None] | None:
    rounds = _rounds(events)
    if not rounds:
        return None
    if step is None:  # the latest round that drafted anything (the last one may have had no budget left)
        return next((r for r in reversed(rounds) if r[0].tokens), rounds[-1])
    return next((r for r in rounds if r[0].step == step), None)


def _status(d: EagleDraft, tree: TreeRound | None, i: int) -> str:
    if d.kept[i] < 0:
        return CUT
    return "accepted" if tree is not None and d.kept[i] in tree.accepted else VERIFIED


def _hover(d: EagleDraft, tree: TreeRound | None, i: int) -> str:
    lines = [
        f"{_shown(d.texts[i])} · depth {d.depths[i]} · rank {d.ranks[i] + 1}",
        f"c(x) = {d.scores[i]:.3f} (exp = {math.exp(d.scores[i]):.3f}), q = {d.q[i]:.3f}",
    ]
    if tree is not None and d.kept[i] >= 0 and d.kept[i] < len(tree.p):
        lines.append(f"target p = {tree.p[d.kept[i]]:.3f}")
    lines.append(("expanded · " if d.expanded[i] else "") + _status(d, tree, i))
    return "<br>".join(lines)


def _layout(d: EagleDraft, tree: TreeRound | None, width: float | None) -> tuple[TreeLayout, dict]:
    """The layout of the kept nodes with the candidates cut by the rerank folded into one "+n" node per parent,
    and the labels that fit (fitted once, for the verified tree; every frame shows a subset of those nodes)."""
    depths = [depth + 1 for depth in d.depths]  # x: 0 = the committed root
    lay = TreeLayout.build(d.parents, depths, {i for i in range(len(d.tokens)) if d.kept[i] >= 0}, root_x=0.0)
    lay.make_room(SLIDER_MARGIN)
    last = next((i for i in lay.shown if tree is not None and tree.accepted and d.kept[i] == tree.accepted[-1]), -1)
    lay.x["next"], lay.y["next"] = (depths[last] + 1, lay.y[last]) if last >= 0 else (1.0, lay.y["root"])
    groups = [("group", g) for g in range(len(lay.groups))]
    keys = ["root", "next", *lay.shown, *groups]
    texts = ["root", _shown(tree.next_text) if tree else "", *(_shown(d.texts[i]) for i in lay.shown)]
    texts += [f"+{len(hidden)}" for _, hidden in lay.groups]
    accepted = {i for i in lay.shown if _status(d, tree, i) == "accepted"}
    priority = [100.0, 99.0, *((50.0 if i in accepted else 0.0) + d.scores[i] for i in lay.shown)]
    priority += [-100.0] * len(groups)
    return lay, lay.labels(keys, texts, priority, width=width)


def _edges(d: EagleDraft, lay: TreeLayout, keys: list) -> go.Scatter:
    xs, yy = [], []
    for key in keys:
        parent = d.parents[key] if isinstance(key, int) else lay.groups[key[1]][0]
        start = "root" if parent < 0 else parent
        xs += [lay.x[start], lay.x[key], None]
        yy += [lay.y[start], lay.y[key], None]
    line = {"color": "#cbd5e1", "width": 1}
    return go.Scatter(x=xs, y=yy, mode="lines", line=line, hoverinfo="skip", showlegend=False)


def _group_hover(d: EagleDraft, hidden: list[int]) -> str:
    best = sorted(hidden, key=lambda i: -d.scores[i])[:10]
    rows = "<br>".join(f"{_shown(d.texts[i])}: c(x) = {d.scores[i]:.2f}" for i in best)
    return f"{len(hidden)} candidates cut by the rerank (best shown):<br>{rows}"


def _nodes(d: EagleDraft, tree, lay: TreeLayout, labels: dict, keys: list, name: str, color) -> go.Scatter:
    outline = [2.5 if isinstance(k, int) and d.expanded[k] else 0.5 for k in keys]
    marker = {"size": 14, "color": color, "line": {"width": outline, "color": "#0f172a"}}
    if not isinstance(color, str):
        marker.update(colorscale=PROBABILITY_COLORSCALE, cmin=0, cmax=1, colorbar={"title": "exp c(x)", "len": 0.6})
    hovers = [_hover(d, tree, k) if isinstance(k, int) else _group_hover(d, lay.groups[k[1]][1]) for k in keys]
    return go.Scatter(
        x=[lay.x[k] for k in keys],
        y=[lay.y[k] for k in keys],
        mode="markers+text",
        name=name,
        text=[labels[k] for k in keys],
        textposition="middle right",
        textfont={"size": LABEL_FONT},
        marker=marker,
        hovertext=hovers,
        hoverinfo="text",
    )


def _phase(d: EagleDraft, tree: TreeRound | None, lay: TreeLayout, labels: dict, phase: str, level: int) -> list:
    """The traces of one slider position: growth up to `level`, the rerank cut or the verified tree."""
    groups = [("group", g) for g in range(len(lay.groups))]
    root = go.Scatter(
        x=[lay.x["root"]],
        y=[lay.y["root"]],
        mode="markers+text",
        name="root (committed)",
        text=[labels["root"]],
        textposition="middle left",
        textfont={"size": LABEL_FONT},
        marker={"size": 14, "color": STATUS_COLORS["target"]},
    )
    if phase == "grow":
        shown = [i for i in lay.shown if d.depths[i] <= level]
        shown_groups = [g for g in groups if lay.x[g] - 1 <= level]
        colors = [math.exp(d.scores[i]) for i in shown]
        traces = [_edges(d, lay, shown + shown_groups), root]
        traces.append(_nodes(d, tree, lay, labels, shown, "candidate (colour = exp c(x))", colors))
        return traces + [_nodes(d, tree, lay, labels, shown_groups, CUT, PHASE_COLORS[CUT])]
    traces = [_edges(d, lay, lay.shown + groups), root]
    statuses = ["kept"] if phase == "rerank" else [VERIFIED, "accepted"]
    for status in statuses:
        nodes = lay.shown if status == "kept" else [i for i in lay.shown if _status(d, tree, i) == status]
        color = STATUS_COLORS["bonus"] if status == "kept" else PHASE_COLORS[status]
        traces.append(_nodes(d, tree, lay, labels, nodes, status, color))
    traces.append(_nodes(d, tree, lay, labels, groups, CUT, PHASE_COLORS[CUT]))
    if phase == "verify" and tree is not None:
        traces.append(
            go.Scatter(
                x=[lay.x["next"]],
                y=[lay.y["next"]],
                mode="markers+text",
                name=f"target's {tree.next_source}",
                text=[labels["next"]],
                textposition="middle right",
                textfont={"size": LABEL_FONT},
                marker={"size": 14, "symbol": "diamond", "color": STATUS_COLORS[tree.next_source]},
                hovertext=[f"{tree.next_source}: {_shown(tree.next_text)}"],
                hoverinfo="text",
            )
        )
    return traces


def growth_figure(events: list[Event], step: int | None = None, width: float | None = None) -> go.Figure:
    """One round's draft tree: growth depth by depth, the rerank cut, then verification (slider). Candidates cut by
    the rerank are folded into one "+n" node per parent (their best ones on hover)."""
    picked = _pick(events, step)
    title = "EAGLE-2 draft tree: growth, rerank, verification"
    if picked is None or not picked[0].tokens:
        return empty_figure(title, PLACEHOLDER, height=420)
    d, tree = picked
    lay, labels = _layout(d, tree, width)
    levels = max(d.depths) + 1
    phases = [("grow", level, f"depth {level}") for level in range(levels)]
    phases += [("rerank", 0, f"rerank (keep {sum(k >= 0 for k in d.kept)})"), ("verify", 0, "verified")]
    frames = [go.Frame(data=_phase(d, tree, lay, labels, kind, level), name=label) for kind, level, label in phases]
    fig = go.Figure(data=frames[-1].data, frames=frames)
    slider_steps = [
        {
            "label": label,
            "method": "animate",
            "args": [
                [label],
                {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}},
            ],
        }
        for _, _, label in phases
    ]
    accepted = len(tree.accepted) if tree else 0
    kept = sum(k >= 0 for k in d.kept)
    fig.update_layout(**base_layout(f"{title} · round {d.step}: {accepted} accepted of {kept}", lay.height))
    apply_frame(fig, lay)
    plot_h = lay.height - SLIDER_MARGIN - 48
    fig.update_layout(
        sliders=[
            {"active": len(phases) - 1, "steps": slider_steps, "y": -40 / plot_h, "currentvalue": {"prefix": "show: "}}
        ],
        legend={"y": -150 / plot_h},
    )
    fig.update_xaxes(title="depth (0 = committed root)", dtick=1)
    return fig


def rerank_figure(events: list[Event], step: int | None = None) -> go.Figure:
    """c(x) of every candidate against its depth, with the rerank threshold."""
    picked = _pick(events, step)
    title = "EAGLE-2 rerank: cumulative log-probability c(x) per candidate"
    if picked is None or not picked[0].tokens:
        return empty_figure(title, PLACEHOLDER, height=320)
    d, tree = picked
    fig = go.Figure()
    for status in (CUT, VERIFIED, "accepted"):
        nodes = [i for i in range(len(d.tokens)) if _status(d, tree, i) == status]
        fig.add_trace(
            go.Scatter(
                x=[d.depths[i] for i in nodes],
                y=[d.scores[i] for i in nodes],
                mode="markers",
                name=status,
                marker={"size": 9, "color": PHASE_COLORS[status], "opacity": 0.85},
                hovertext=[_hover(d, tree, i) for i in nodes],
                hoverinfo="text",
            )
        )
    fig.add_hline(
        y=d.threshold,
        line={"dash": "dash", "color": "#0f172a", "width": 1},
        annotation_text=f"keep the best {d.total_tokens}: c(x) >= {d.threshold:.2f}",
    )
    fig.update_layout(**base_layout(f"{title} · round {d.step}", 320))
    fig.update_xaxes(title="depth", dtick=1)
    fig.update_yaxes(title="c(x) = sum log q")
    return fig


def calibration_points(events: list[Event]) -> dict[str, list[tuple[float, bool]]]:
    """(confidence, accepted) per verified node: cumulative exp(c(x)), and q(x | parent) for nodes whose
    parent was accepted (or is the root)."""
    points: dict[str, list[tuple[float, bool]]] = {"cumulative": [], "conditional": []}
    for tree in (e for e in events if isinstance(e, TreeRound) and e.method == "eagle"):
        accepted, confidence = set(tree.accepted), []
        for i, (parent, q) in enumerate(zip(tree.parents, tree.q, strict=True)):
            confidence.append(q * (confidence[parent] if parent >= 0 else 1.0))
            points["cumulative"].append((confidence[i], i in accepted))
            if parent < 0 or parent in accepted:
                points["conditional"].append((q, i in accepted))
    return points


def _binned(points: list[tuple[float, bool]]) -> tuple[list[float], list[float], list[int]]:
    """Mean confidence, acceptance share and count per non-empty bin of width 1 / BINS."""
    bins: list[list[tuple[float, bool]]] = [[] for _ in range(BINS)]
    for confidence, ok in points:
        bins[min(int(confidence * BINS), BINS - 1)].append((confidence, ok))
    full = [b for b in bins if b]
    return (
        [sum(c for c, _ in b) / len(b) for b in full],
        [sum(ok for _, ok in b) / len(b) for b in full],
        [len(b) for b in full],
    )


def calibration_figure(events: list[Event]) -> go.Figure:
    """Draft confidence vs realised acceptance (binned), with the diagonal."""
    title = "Calibration: draft confidence vs realised acceptance"
    points = calibration_points(events)
    if not points["cumulative"]:
        return empty_figure(title, PLACEHOLDER, height=340)
    fig = go.Figure(
        go.Scatter(
            x=[0, 1],
            y=[0, 1],
            mode="lines",
            name="perfectly calibrated",
            line={"dash": "dot", "color": "#94a3b8"},
            hoverinfo="skip",
        )
    )
    styles = {
        "cumulative": ("exp c(x) vs on the accepted path", STATUS_COLORS["bonus"]),
        "conditional": ("q(x | parent) vs accepted, parent accepted", STATUS_COLORS["accepted"]),
    }
    for key, (name, color) in styles.items():
        x, y, n = _binned(points[key])
        hover = [f"confidence {a:.2f}: {b:.0%} accepted of {c} nodes" for a, b, c in zip(x, y, n, strict=True)]
        sizes = [6 + 14 * math.sqrt(c / max(n)) for c in n]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers",
                name=name,
                line={"color": color},
                marker={"size": sizes, "color": color},
                hovertext=hover,
                hoverinfo="text",
            )
        )
    fig.update_layout(**base_layout(f"{title} ({len(points['cumulative'])} verified nodes)", 340))
    fig.update_xaxes(title="draft confidence", range=[-0.02, 1.02])
    fig.update_yaxes(title="share accepted", range=[-0.02, 1.02])
    return fig


def tau_figure(events: list[Event]) -> go.Figure:
    """Tokens per round and the running mean tau (mean accepted length, the target's token included)."""
    title = "Tokens per round (tau = running mean)"
    trees = [e for e in events if isinstance(e, TreeRound) and e.method == "eagle"]
    if not trees:
        return empty_figure(title, PLACEHOLDER, height=280)
    steps, emitted = [t.step for t in trees], [t.emitted for t in trees]
    running = [sum(emitted[: i + 1]) / (i + 1) for i in range(len(emitted))]
    fig = go.Figure(
        go.Bar(
            x=steps,
            y=emitted,
            name="tokens this round",
            marker={"color": STATUS_COLORS["accepted"]},
            hovertext=[
                f"round {s}: {e} tokens from a tree of {len(t.tokens)}"
                for s, e, t in zip(steps, emitted, trees, strict=True)
            ],
            hoverinfo="text",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=steps,
            y=running,
            mode="lines",
            name="tau (running mean)",
            line={"color": STATUS_COLORS["bonus"], "width": 2},
        )
    )
    fig.update_layout(**base_layout(f"{title}: tau = {running[-1]:.2f}", 280))
    fig.update_xaxes(title="round")
    fig.update_yaxes(title="tokens")
    return fig


def inspect_round(events: list[Event], step: int) -> go.Figure:
    """The app's step inspector: the growth figure of the round that emitted `step`'s tokens, at full width."""
    return growth_figure(events, step, width=WIDE_PLOT_PX)


VIEWS = {
    "eagle": StrategyView(
        figures=(growth_figure, rerank_figure, calibration_figure, tau_figure), inspect=inspect_round
    ),
}
