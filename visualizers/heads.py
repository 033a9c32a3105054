"""Live views of the multi-token-head strategies (Medusa, MTPC), drawn from `TreeRound` and `MixtureRound` events.

Covers, each with an empty state before the first round:
- `tree_figure(events, step)`: one round's candidate tree (default the latest) as a layered node-link plot
  (x = draft position, the root = last committed token on the left, parents centred over their children), one
  trace per status so the legend toggles them: accepted (on the kept path), rejected (examined: its parent was
  on the path, the target chose otherwise), pruned (never reached: greyed), and the target's next token
  (recovered or bonus). Hover: token, head, rank, q (drafter) and p (target);
- `head_topk_figure(events, step)`: the top tokens of each head / draft position at that round (a heatmap, the
  token written in each cell; for MTPC the circuit's marginal given the root);
- `mask_figure(events, step)`: the tree attention mask of the verify forward (root + nodes; a cell is on when
  the row's node attends to the column's node: itself and its ancestors);
- `pairs_figure(events, step)` (MTPC): the top pairs of the first two draft positions, P under the joint next to
  the product of marginals, pairs the joint suppresses (joint < half the product) marked;
- `mixture_figure(events)` (MTPC): P(z | h) and P(z | h, root) per round;
- `accepted_length_figure(events)` and `compare_accepted_lengths({name: events})`: the histogram of tokens per
  round (accepted + the target's token) per method, e.g. a Medusa run next to an MTPC run.
Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

from collections import Counter

import plotly.graph_objects as go

from lab.trace import Event, MixtureRound, TokenEmitted, TreeRound
from visualizers.labels import LABEL_FONT, NARROW_PLOT_PX, WIDE_PLOT_PX, cell_text
from visualizers.style import PROBABILITY_COLORSCALE, STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure
from visualizers.treeview import TreeLayout, apply_frame
from visualizers.view import StrategyView

PLACEHOLDER = "Run Medusa or MTPC to see its candidate trees."
SUPPRESSED = 0.5  # a pair is "suppressed" when joint < 0.5 * product of marginals
METHOD_COLORS = {"medusa": "#1f77b4", "mtpc": "#9467bd", "eagle": "#ff7f0e"}
TOPK_ROW_PX, TOPK_FONT = 22, 11  # one rank per row of the per-head top-k, tokens written at 11 px


def _shown(text: str) -> str:
    return display_token(text)


def _round(events: list[Event], step: int | None, kind: type = TreeRound):
    """The round of `step`; with no step, the latest round that drafted anything (the last one may have had no
    budget left: a tree of the root alone), so every round figure shows the same round."""
    rounds = [e for e in events if isinstance(e, kind)]
    if not rounds:
        return None
    if step is None:
        return next((r for r in reversed(rounds) if getattr(r, "tokens", True)), rounds[-1])
    return next((r for r in rounds if r.step == step), None)


def node_status(tree: TreeRound) -> list[str]:
    """accepted (on the kept path), rejected (its parent was reached, the node was not kept) or pruned."""
    kept = set(tree.accepted)
    reached = kept | {-1}
    return ["accepted" if i in kept else "rejected" if p in reached else "pruned" for i, p in enumerate(tree.parents)]


def _hover(tree: TreeRound, i: int, status: str) -> str:
    return (
        f"<b>{display_token(tree.texts[i])}</b> ({status})<br>"
        f"position {tree.depths[i] + 1}, head {tree.heads[i] + 1}, rank {tree.ranks[i] + 1}<br>"
        f"q (drafter) = {tree.q[i]:.3f}<br>p (target) = {tree.p[i]:.3f}"
    )


def tree_figure(events: list[Event], step: int | None = None, collapse: bool = True, width: float | None = None):
    """Candidate tree of one round: nodes by status, edges, the root and the target's next token. With `collapse`,
    the branches never reached (pruned) are folded into one "+n" node under the rejected node they hang from;
    labels are written where they fit at the plot `width` (px, default the narrow side-by-side width)."""
    title = "Candidate tree"
    tree = _round(events, step)
    if tree is None:
        return empty_figure(title, PLACEHOLDER, height=380)
    status = node_status(tree)
    keep = {i for i, s in enumerate(status) if s != "pruned"} if collapse else set(range(len(status)))
    lay = TreeLayout.build(tree.parents, tree.depths, keep, root_x=-1.0)
    last = tree.accepted[-1] if tree.accepted else None
    lay.x["next"], lay.y["next"] = (tree.depths[last] + 1, lay.y[last]) if last is not None else (0, lay.y["root"])
    groups = [("group", g) for g in range(len(lay.groups))]
    keys = ["root", "next", *lay.shown, *groups]
    texts = [_shown(tree.root_text), _shown(tree.next_text), *(_shown(tree.texts[i]) for i in lay.shown)]
    texts += [f"+{len(hidden)}" for _, hidden in lay.groups]
    rank = {"accepted": 50.0, "rejected": 10.0, "pruned": 0.0}
    priority = [100.0, 99.0, *(rank[status[i]] + tree.q[i] for i in lay.shown), *([-1.0] * len(groups))]
    labels = lay.labels(keys, texts, priority, width=width)
    fig = go.Figure(_tree_edges(tree, lay))
    fig.add_trace(_marker(lay, ["root"], labels, "root (last token)", STATUS_COLORS["target"], ["root"]))
    fig.data[-1].textposition = "middle left"
    for kind in ("accepted", "rejected", "pruned"):
        nodes = [i for i in lay.shown if status[i] == kind]
        hovers = [_hover(tree, i, kind) for i in nodes]
        fig.add_trace(_marker(lay, nodes, labels, kind, STATUS_COLORS[kind], hovers))
    if groups:
        hovers = [_group_hover(tree, hidden) for _, hidden in lay.groups]
        fig.add_trace(_marker(lay, groups, labels, "pruned (collapsed)", STATUS_COLORS["pruned"], hovers))
    name = display_token(tree.next_text)
    hover = [f"<b>{name}</b>: the target's token ({tree.next_source})"]
    fig.add_trace(_marker(lay, ["next"], labels, tree.next_source, STATUS_COLORS[tree.next_source], hover))
    fig.data[-1].marker.symbol = "diamond"
    subtitle = f"round {tree.step} ({tree.method}, {tree.mode}): {len(tree.tokens)} nodes, {len(tree.accepted)} kept"
    fig.update_layout(**base_layout(f"{title}, {subtitle}", lay.height))
    apply_frame(fig, lay)
    ticks = list(range(-1, max(tree.depths, default=-1) + 3))
    fig.update_xaxes(title="draft position", tickvals=ticks, ticktext=["root"] + [str(t + 1) for t in ticks[1:]])
    return fig


def _tree_edges(tree: TreeRound, lay: TreeLayout) -> go.Scatter:
    edge_x, edge_y = [], []
    ends = [(tree.parents[i], i) for i in lay.shown] + [(a, ("group", g)) for g, (a, _) in enumerate(lay.groups)]
    for parent, node in ends:
        start = "root" if parent < 0 else parent
        edge_x += [lay.x[start], lay.x[node], None]
        edge_y += [lay.y[start], lay.y[node], None]
    line = {"color": "#cbd5e1", "width": 1}
    return go.Scatter(x=edge_x, y=edge_y, mode="lines", line=line, hoverinfo="skip", showlegend=False)


def _group_hover(tree: TreeRound, hidden: list[int]) -> str:
    tokens = ", ".join(_shown(tree.texts[i]) for i in hidden[:12]) + (" …" if len(hidden) > 12 else "")
    return f"{len(hidden)} pruned candidates (never reached): {tokens}"


def _marker(lay: TreeLayout, keys: list, labels: dict, name: str, color: str, hovers) -> go.Scatter:
    return go.Scatter(
        x=[lay.x[k] for k in keys],
        y=[lay.y[k] for k in keys],
        mode="markers+text",
        name=name,
        text=[labels[k] for k in keys],
        textposition="middle right",
        textfont={"size": LABEL_FONT},
        marker={"size": 13, "color": color, "line": {"width": 1, "color": "white"}},
        hovertext=hovers,
        hoverinfo="text",
    )


def head_topk_figure(events: list[Event], step: int | None = None) -> go.Figure:
    """Top tokens per head (draft position) at one round: one column per head, its ranks down the column,
    probability as colour, the token written in its cell (columns are wide enough for a word; k rows of a line)."""
    title = "Per-head top-k"
    tree = _round(events, step)
    if tree is None or not tree.head_top_probs:
        return empty_figure(title, PLACEHOLDER, height=260)
    heads = [f"head {k + 1}<br>x t+{k + 2}" for k in range(len(tree.head_top_probs))]
    depth = max(len(r) for r in tree.head_top_probs)
    z = [[r[i] if i < len(r) else None for r in tree.head_top_probs] for i in range(depth)]  # [rank][head]
    by_head = [[_shown(t) for t in r] + [""] * (depth - len(r)) for r in tree.head_top_texts]
    hover_texts = [[column[i] for column in by_head] for i in range(depth)]
    height = 110 + TOPK_ROW_PX * depth
    texts = cell_text(hover_texts, len(heads), depth, NARROW_PLOT_PX - 100, TOPK_ROW_PX * depth, TOPK_FONT)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=heads,
            y=[f"#{i + 1}" for i in range(depth)],
            text=texts,
            customdata=hover_texts,
            texttemplate="%{text}",
            textfont={"size": TOPK_FONT},
            colorscale=PROBABILITY_COLORSCALE,
            zmin=0,
            zmax=1,
            hovertemplate="%{x}, rank %{y}: %{customdata} p=%{z:.3f}<extra></extra>",
            colorbar={"title": "prob"},
        )
    )
    fig.update_layout(**base_layout(f"{title}, round {tree.step} ({tree.method})", height))
    fig.update_yaxes(autorange="reversed", title_text="rank")
    return fig


def attention_mask(parents: list[int]) -> list[list[int]]:
    """Ancestor matrix of root + nodes (row attends to column), the root being index 0."""
    full = [-1] + [p + 1 for p in parents]
    mask = []
    for i in range(len(full)):
        row, node = [0] * len(full), i
        while node != -1:
            row[node] = 1
            node = full[node] if node else -1
        mask.append(row)
    return mask


def mask_figure(events: list[Event], step: int | None = None) -> go.Figure:
    """The tree attention mask of one round's verify forward (the cached prefix columns, all on, left out)."""
    title = "Tree attention mask"
    tree = _round(events, step)
    if tree is None:
        return empty_figure(title, PLACEHOLDER, height=360)
    labels = distinct_labels([f"{_shown(tree.root_text)} (root)"] + [_shown(t) for t in tree.texts])
    fig = go.Figure(
        go.Heatmap(
            z=attention_mask(tree.parents),
            x=labels,
            y=labels,
            colorscale=[[0, "#f8fafc"], [1, STATUS_COLORS["bonus"]]],
            showscale=False,
            xgap=1,
            ygap=1,
            hovertemplate="%{y} attends to %{x}: %{z}<extra></extra>",
        )
    )
    rows = f"{len(labels)} token{'s' * (len(labels) != 1)}"
    fig.update_layout(**base_layout(f"{title}, round {tree.step}: {rows} in one forward", 380))
    fig.update_yaxes(autorange="reversed")
    return fig


def pairs_figure(events: list[Event], step: int | None = None) -> go.Figure:
    """MTPC: the first two draft positions' top pairs, joint vs product of marginals."""
    title = "Joint vs independent: top pairs of positions 1-2"
    mix = _round(events, step, MixtureRound)
    if mix is None:
        return empty_figure(title, "Run MTPC to see its joint predictions.", height=320)
    labels = distinct_labels([f"{_shown(a)} · {_shown(b)}" for a, b in mix.pair_texts])
    suppressed = [j < SUPPRESSED * p for j, p in zip(mix.joint, mix.product, strict=True)]
    shown = [f"{label} ✗" if s else label for label, s in zip(labels, suppressed, strict=True)]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=shown, y=mix.joint, name="joint (circuit)", marker={"color": METHOD_COLORS["mtpc"]}))
    fig.add_trace(
        go.Bar(x=shown, y=mix.product, name="product of marginals", marker={"color": METHOD_COLORS["medusa"]})
    )
    fig.update_layout(**base_layout(f"{title} (round {mix.step}; ✗ = suppressed by the joint)", 320))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title="probability")
    return fig


def mixture_figure(events: list[Event]) -> go.Figure:
    """MTPC: the mixture weights P(z | h) (prior) and P(z | h, root) per round as heatmaps."""
    title = "Mixture weights per round"
    rounds = [e for e in events if isinstance(e, MixtureRound)]
    if not rounds:
        return empty_figure(title, "Run MTPC to see its mixture weights.", height=300)
    steps = [r.step for r in rounds]
    components = [f"z={z + 1}" for z in range(len(rounds[0].prior))]
    fig = go.Figure()
    for name, values, visible in (("P(z | h, root)", "posterior", True), ("P(z | h)", "prior", "legendonly")):
        z = [[getattr(r, values)[c] for r in rounds] for c in range(len(components))]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=steps,
                y=components,
                zmin=0,
                zmax=1,
                colorscale=PROBABILITY_COLORSCALE,
                name=name,
                visible=visible,
                showlegend=True,
                hovertemplate=f"round %{{x}}, %{{y}}: {name} = %{{z:.3f}}<extra></extra>",
            )
        )
    fig.update_layout(**base_layout(f"{title} (toggle prior / posterior in the legend)", 300))
    fig.update_xaxes(title="round")
    return fig


def compare_accepted_lengths(runs: dict[str, list[Event]]) -> go.Figure:
    """Histogram of tokens per round (bonus included) for each named run, with its mean tau in the legend."""
    title = "Tokens per round (accepted + the target's token)"
    series = {name: [e.emitted for e in ev if isinstance(e, TreeRound)] for name, ev in runs.items()}
    series = {name: values for name, values in series.items() if values}
    if not series:
        return empty_figure(title, PLACEHOLDER, height=300)
    fig = go.Figure()
    for name, values in series.items():
        counts = Counter(values)
        xs = sorted(counts)
        share = [counts[x] / len(values) for x in xs]
        tau = sum(values) / len(values)
        color = METHOD_COLORS.get(name.split()[0])
        fig.add_trace(go.Bar(x=xs, y=share, name=f"{name}: tau {tau:.2f} ({len(values)} rounds)", marker_color=color))
    fig.update_layout(**base_layout(title, 300))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="tokens per round", dtick=1)
    fig.update_yaxes(title="share of rounds")
    return fig


def accepted_length_figure(events: list[Event]) -> go.Figure:
    """This run's histogram of tokens per round, one series per method in the trace."""
    methods = sorted({e.method for e in events if isinstance(e, TreeRound)})
    return compare_accepted_lengths(
        {m: [e for e in events if isinstance(e, TreeRound) and e.method == m] for m in methods}
    )


def accepted_steps(events: list[Event]) -> set[int]:
    """Rounds (token steps) in which the target kept at least one drafted token."""
    return {e.step for e in events if isinstance(e, TokenEmitted) and e.source == "accepted"}


def inspect_round(events: list[Event], step: int, **_knobs: float) -> go.Figure:
    """The inspector's full-width tree of the round of `step`, every node shown (nothing collapsed)."""
    return tree_figure(events, step, collapse=False, width=WIDE_PLOT_PX)


VIEWS = {
    "medusa": StrategyView(
        figures=(tree_figure, head_topk_figure, mask_figure, accepted_length_figure),
        highlight_steps=accepted_steps,
        highlight_label="rounds with accepted draft tokens",
        inspect=inspect_round,
    ),
    "mtpc": StrategyView(
        figures=(tree_figure, pairs_figure, mixture_figure, head_topk_figure, mask_figure, accepted_length_figure),
        highlight_steps=accepted_steps,
        highlight_label="rounds with accepted draft tokens",
        inspect=inspect_round,
    ),
}
