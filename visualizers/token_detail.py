"""One token's own distribution, the single source of the token view's tooltip, the inspector and "Branch from here".

Covers: `ranked(event)` (the ranked alternatives of one TokenEmitted: rank, text, id, p, chosen), `token_detail(events,
index)` (the index-th token of a run, its round and position in the round, and the drafter's q at that position
where the trace records one: a chain round's drafted token and its alt_q, or a tree round's candidates under the
accepted path), `token_rows` (the inspector's table) and `token_figure` (p of the target at that position as bars,
with the draft's q beside it where one exists). p is the distribution the token was chosen from (by losslessness,
the target's at that position), so a token emitted in the third slot of a verified round shows its own p, not the
round's first. Not covered: the round-level figures (each strategy's `StrategyView.inspect`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import plotly.graph_objects as go

from lab.trace import DraftRound, Event, TokenEmitted, TreeRound
from visualizers.style import STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure

PROB_DIGITS = 4
DRAFT_COLOR = "#f59e0b"


@dataclass(frozen=True)
class Alternative:
    rank: int
    text: str
    token_id: int | None
    p: float
    chosen: bool


@dataclass(frozen=True)
class TokenDetail:
    """The index-th emitted token, its place in its round (offset 0 = the round's first token) and the draft's q
    by token text at that position ({} where nothing was drafted there)."""

    index: int
    event: TokenEmitted
    offset: int
    q: dict[str, float] = field(default_factory=dict)


def ranked(event: TokenEmitted) -> list[Alternative]:
    """The token's alternatives, most likely first, with the emitted one marked."""
    ids = list(event.top_ids) + [None] * max(0, len(event.top_tokens) - len(event.top_ids))
    rows = zip(event.top_tokens, ids, event.top_probs, strict=False)
    return [Alternative(r, text, i, p, i == event.token_id) for r, (text, i, p) in enumerate(rows, start=1)]


def _chain_q(round_: DraftRound, offset: int) -> dict[str, float]:
    if offset >= len(round_.draft_tokens):
        return {}
    q = dict(zip(round_.alt_texts[offset], round_.alt_q[offset], strict=False)) if offset < len(round_.alt_q) else {}
    q[round_.draft_texts[offset]] = round_.q[offset]
    return q


def _tree_q(round_: TreeRound, offset: int) -> dict[str, float]:
    """q of the candidates drafted at `offset` under the accepted path (the root's children at offset 0)."""
    if offset > len(round_.accepted):
        return {}
    parent = -1 if offset == 0 else round_.accepted[offset - 1]
    return {t: q for t, q, p in zip(round_.texts, round_.q, round_.parents, strict=False) if p == parent}


def token_detail(events: list[Event], index: int) -> TokenDetail | None:
    """The index-th TokenEmitted of the run with its round context; None when there is no such token."""
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    if not 0 <= index < len(tokens):
        return None
    event = tokens[index]
    offset = index - next(i for i, e in enumerate(tokens) if e.step == event.step)
    round_ = next((e for e in events if isinstance(e, DraftRound | TreeRound) and e.step == event.step), None)
    if isinstance(round_, DraftRound):
        q = _chain_q(round_, offset)
    elif isinstance(round_, TreeRound):
        q = _tree_q(round_, offset)
    else:
        q = {}
    return TokenDetail(index, event, offset, q)


def token_rows(detail: TokenDetail | None) -> list[list]:
    """Rows [rank, token, p, draft q] of the token's alternatives (q "" where the draft had none)."""
    if detail is None:
        return []
    rows = []
    for alt in ranked(detail.event):
        q = detail.q.get(alt.text)
        shown = display_token(alt.text, escape=False) + ("  ◀" if alt.chosen else "")
        rows.append([alt.rank, shown, round(alt.p, PROB_DIGITS), "" if q is None else round(q, PROB_DIGITS)])
    return rows


def token_title(detail: TokenDetail) -> str:
    event = detail.event
    where = f"step {event.step}" if detail.offset == 0 else f"step {event.step}, position {detail.offset + 1}"
    return f"Token {detail.index + 1} ({where}, {event.source}): {display_token(event.text)}"


def token_figure(events: list[Event], index: int) -> go.Figure:
    """The token's own distribution: p of the alternatives as bars, the draft's q beside them where recorded."""
    detail = token_detail(events, index)
    if detail is None or not detail.event.top_probs:
        reason = "No token there" if detail is None else "This strategy records no alternatives for its tokens"
        return empty_figure(f"Token {index + 1}", reason)
    alts = ranked(detail.event)
    labels = distinct_labels([display_token(a.text) for a in alts])
    colors = [STATUS_COLORS["accepted"] if a.chosen else STATUS_COLORS["target"] for a in alts]
    p = [a.p for a in alts]
    bars = [
        go.Bar(
            x=p, y=labels, orientation="h", name="target p", marker_color=colors,
            text=[f"{v:.2f}" for v in p], textposition="auto",
            hovertext=[f"rank {a.rank} · {lab} · p={a.p:.4f}" for a, lab in zip(alts, labels, strict=True)],
            hoverinfo="text",
        )
    ]  # fmt: skip
    if detail.q:
        q = [detail.q.get(a.text, 0.0) for a in alts]
        bars.append(
            go.Bar(x=q, y=labels, orientation="h", name="draft q", marker_color=DRAFT_COLOR,
                   hovertext=[f"{lab} · q={v:.4f}" for lab, v in zip(labels, q, strict=True)], hoverinfo="text")
        )  # fmt: skip
    layout = base_layout(token_title(detail), 90 + (44 if detail.q else 28) * len(labels))
    layout["margin"] = {**layout["margin"], "l": 90}
    fig = go.Figure(bars, layout=layout)
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.08, "yanchor": "top", "x": 0})
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[0, 1])  # the legend names the axis (target p, draft q)
    return fig
