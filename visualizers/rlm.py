"""Recursive Language Models' live views (Zhang, Kraska, Khattab 2025), drawn from `ReplCall` events.

Covers three figures, each with an empty state before the first call:
- `call_tree_figure`: the recursion tree (its title names the REPL's isolation level: full sandbox, or not a
  sandbox): root turns (x = depth 0, top to bottom in order) and the llm_query
  sub-calls each made (x = depth), linked to their parent; hover shows the action or code, the output, the
  context ranges read, tokens and latency; failed calls are red, the answering turn orange;
- `coverage_figure`: which characters of the context each call read (one row per call, bars over character
  positions; grep / whole-string scans cover everything) and their union on the top row;
- `transcript_figure`: the REPL transcript as a table (call, role, depth, action / code, output or error,
  tokens, seconds), with the grammar's alternatives and their log-probabilities for action-mode turns.
Not covered: the answer's text (the token view shows it). Imports plotly, the standard library and lab.trace.
"""

from __future__ import annotations

import plotly.graph_objects as go

from lab.trace import Event, ReplCall, RlmContext, RlmResult
from visualizers.style import STATUS_COLORS, base_layout, plot_text
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

PLACEHOLDER = "No REPL calls yet"
ROLE_COLORS = {"root": STATUS_COLORS["bonus"], "sub": STATUS_COLORS["accepted"]}
ERROR_COLOR, FINAL_COLOR = STATUS_COLORS["rejected"], STATUS_COLORS["recovered"]
SYMBOLS = {"root": "square", "sub": "circle"}
LEGEND = {"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"}
ISOLATION_TEXT = {  # RlmContext.isolation -> what the REPL ran in (lab.methods.rlm.sandbox.LEVEL_TEXT in short)
    "full": "full sandbox (private uid, namespaces, minimal root, capped tmpfs, Landlock, seccomp; memory per process, "
    "no cgroup)",
    "full-no-root": "full sandbox WITHOUT a minimal root (host paths visible by name; private uid, namespaces, capped "
    "tmpfs, Landlock, seccomp; memory per process, no cgroup)",
    "unisolated": "NOT a sandbox (separate process, resource limits only)",
}


def _esc(text: str) -> str:
    """Prose for hover and table cells: HTML-escaped, newlines as line breaks."""
    return plot_text(text).replace("\n", "<br>")


def _calls(events: list[Event]) -> list[ReplCall]:
    return [e for e in events if isinstance(e, ReplCall)]


def _context(events: list[Event]) -> RlmContext | None:
    return next((e for e in events if isinstance(e, RlmContext)), None)


def _ordered(calls: list[ReplCall]) -> list[ReplCall]:
    """Root turns in order, each followed by its sub-call subtree (depth first, by call id)."""
    children: dict[int, list[ReplCall]] = {}
    for call in sorted(calls, key=lambda c: c.call_id):
        children.setdefault(call.parent_id, []).append(call)
    out: list[ReplCall] = []

    def visit(call: ReplCall) -> None:
        out.append(call)
        for child in children.get(call.call_id, []):
            visit(child)

    for root in children.get(-1, []):
        visit(root)
    known = {c.call_id for c in out}
    return out + [c for c in calls if c.call_id not in known]  # sub-calls whose parent is not emitted yet


def _label(call: ReplCall) -> str:
    if call.role == "root":
        first_line = call.code.strip().splitlines()[0][:40] if call.code.strip() else "(no code)"
        return call.action or first_line
    return f"llm_query #{call.call_id}"


def _ranges_text(call: ReplCall) -> str:
    shown = ", ".join(f"[{a}:{b}]" for a, b in call.ranges[:6])
    return shown + (f" … (+{len(call.ranges) - 6})" if len(call.ranges) > 6 else "") or "none"


def _hover(call: ReplCall) -> str:
    body = call.action or call.code
    output = call.error or call.output
    return (
        f"call {call.call_id} ({call.role}, depth {call.depth}, parent {call.parent_id})<br>"
        f"{_esc(body[:300])}<br>→ {_esc(output[:300])}"
        f"<br>ranges read: {_ranges_text(call)}<br>tokens: {call.prompt_tokens} prompt + {call.output_tokens} out"
        f"<br>latency: {call.latency_s:.2f} s" + (f"<br>FINAL: {_esc(call.final)}" if call.final else "")
    )


def _color(call: ReplCall) -> str:
    if call.error:
        return ERROR_COLOR
    return FINAL_COLOR if call.final is not None else ROLE_COLORS.get(call.role, STATUS_COLORS["target"])


def isolation_text(events: list[Event]) -> str:
    """The isolation level the run's REPL had, in words ("" before the RlmContext event)."""
    context = _context(events)
    return "" if context is None else ISOLATION_TEXT.get(context.isolation, context.isolation)


def call_tree_figure(events: list[Event]) -> go.Figure:
    """The recursion tree: root turns down the left, sub-calls to the right at their depth; the title names the
    REPL's isolation level."""
    calls = _ordered(_calls(events))
    level = isolation_text(events)
    title = "RLM call tree: root turns → code → llm_query sub-calls" + (f"<br>REPL: {level}" if level else "")
    if not calls:
        return empty_figure(title, PLACEHOLDER)
    row = {call.call_id: index for index, call in enumerate(calls)}
    fig = go.Figure()
    edges_x: list[float | None] = []
    edges_y: list[float | None] = []
    previous_root = None
    for call in calls:
        parent = call.call_id if call.parent_id < 0 else call.parent_id
        if call.parent_id < 0 and previous_root is not None:
            parent = previous_root
        if call.parent_id < 0:
            previous_root = call.call_id
        if parent in row and parent != call.call_id:
            parent_call = calls[row[parent]]
            edges_x += [parent_call.depth, call.depth, None]
            edges_y += [-row[parent], -row[call.call_id], None]
    fig.add_trace(
        go.Scatter(x=edges_x, y=edges_y, mode="lines", line={"color": "#cbd5e1"}, hoverinfo="skip", showlegend=False)
    )
    for role, name in (("root", "root turn"), ("sub", "sub-call")):
        members = [c for c in calls if c.role == role]
        fig.add_trace(
            go.Scatter(
                x=[c.depth for c in members],
                y=[-row[c.call_id] for c in members],
                mode="markers+text",
                name=name,
                text=[_esc(_label(c)[:48]) for c in members],
                textposition="middle right",
                marker={"size": 14, "color": [_color(c) for c in members], "symbol": SYMBOLS[role]},
                hovertext=[_hover(c) for c in members],
                hoverinfo="text",
            )
        )  # fmt: skip
    max_depth = max(c.depth for c in calls)
    layout = base_layout(title, height=min(900, 160 + 28 * len(calls)))
    layout.update(legend=LEGEND, showlegend=True)
    fig.update_layout(**layout)
    fig.update_xaxes(title_text="depth", range=[-0.3, max_depth + 1.6], dtick=1, zeroline=False)
    fig.update_yaxes(showticklabels=False, zeroline=False)
    return fig


def _union(ranges: list[list[int]], length: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted((max(0, a), min(length, b)) for a, b in ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def coverage_figure(events: list[Event]) -> go.Figure:
    """Which characters of the context each call read, and the union of all reads."""
    calls = [c for c in _ordered(_calls(events)) if c.ranges]
    context = _context(events)
    title = "Context coverage: characters read by each call"
    if not calls or context is None:
        return empty_figure(title, "No context reads yet")
    length = max(1, context.context_chars)
    union = _union([r for c in calls for r in c.ranges], length)
    share = sum(b - a for a, b in union) / length
    rows = [("all calls", union, STATUS_COLORS["target"], "union")]
    rows += [(f"{c.call_id}: {_label(c)[:28]}", _union(c.ranges, length), _color(c), c.role) for c in calls]
    fig = go.Figure()
    for label, spans, color, role in rows:
        fig.add_trace(
            go.Bar(
                y=[_esc(label)] * len(spans),
                x=[b - a for a, b in spans],
                base=[a for a, _ in spans],
                orientation="h",
                marker={"color": color},
                showlegend=False,
                hovertext=[f"{label}<br>[{a}:{b}] ({b - a} chars, {role})" for a, b in spans],
                hoverinfo="text",
            )
        )
    layout = base_layout(f"{title} (union {share:.1%} of {length:,} characters)", height=min(800, 140 + 24 * len(rows)))
    layout.update(barmode="overlay")
    layout["margin"] = {**layout["margin"], "l": 200}
    fig.update_layout(**layout)
    fig.update_xaxes(title_text="character position in the context", range=[0, length])
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def _alternatives(call: ReplCall) -> str:
    ranked = sorted(zip(call.scores, call.alternatives, strict=False), reverse=True)[:5]
    return "<br>".join(f"{_esc(text[:50])}: {score:.2f}" for score, text in ranked)


def transcript_figure(events: list[Event]) -> go.Figure:
    """The REPL transcript as a table, one row per call, in tree order."""
    calls = _ordered(_calls(events))
    result = next((e for e in events if isinstance(e, RlmResult)), None)
    title = "REPL transcript"
    if result is not None:
        verdict = "" if result.correct is None else (" ✓ correct" if result.correct else " ✗ wrong")
        title += f": answer {_esc(result.answer[:40])}{verdict} ({result.stop}, {result.tokens:,} tokens)"
    if not calls:
        return empty_figure(title, PLACEHOLDER)
    columns = ["call", "role", "depth", "action / code", "output", "tokens", "s", "alternatives (log p)"]
    cells = [
        [c.call_id for c in calls],
        [c.role for c in calls],
        [c.depth for c in calls],
        [_esc((c.action or c.code)[:240]) for c in calls],
        [_esc((f"[error] {c.error}" if c.error else c.output)[:240]) for c in calls],
        [c.prompt_tokens + c.output_tokens for c in calls],
        [f"{c.latency_s:.2f}" for c in calls],
        [_alternatives(c) for c in calls],
    ]
    fill = [["#fee2e2" if c.error else ("#eef2ff" if c.role == "root" else "white") for c in calls]] * len(columns)
    table = go.Table(
        columnwidth=[30, 36, 36, 220, 260, 50, 40, 200],
        header={"values": columns, "align": "left", "fill_color": "#e2e8f0"},
        cells={"values": cells, "align": "left", "fill_color": fill, "height": 22},
    )
    fig = go.Figure(table)
    fig.update_layout(**base_layout(title, height=min(900, 180 + 60 * len(calls))))
    return fig


VIEWS = {"rlm": StrategyView(figures=(call_tree_figure, coverage_figure, transcript_figure))}
