"""SSD's live views (Kumar, Dao, May 2026) and the pipeline timeline both speculative strategies share.

Covers three figures, each with an empty state before the first round:
- `timeline_figure`: a Gantt chart of the measured `PipelineSpan`s of the latest rounds, one row per worker
  (target on the main thread, drafter on the main thread, drafter thread), one trace per kind of work (verify,
  draft, extend, wait, probe, branch; the legend toggles them). Vanilla SD records its draft and verify spans
  too, so running SD and SSD on the same prompt gives two timelines to compare (serial vs overlapped); the
  title sums the measured seconds per row. Only recorded spans are drawn: no counterfactual timing;
- `cache_figure`: per round, the branches the drafter thread pre-drafted (bar) and whether the actual outcome
  was in the speculation cache (hit / miss marker, with its rank in drafting order in the hover);
- `fanout_figure`: per position k (tokens accepted before the recovered or bonus token) the mean number of
  guesses pre-drafted and known (planned) per round, against the share of rounds whose outcome had that k.
`VIEWS` registers the ssd view (timeline first, then the SD figures: strip, q vs p, acceptance, speedup) and
extends the speculative view with the timeline. Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.trace import Event, PipelineSpan, SpeculationRound
from visualizers.speculative import acceptance_figure, round_detail_figure, round_inspect, rounds_figure, speedup_figure
from visualizers.style import STATUS_COLORS, base_layout, display_token, plot_text
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

ROWS = (
    ("target", "main", "target"),
    ("drafter", "main", "drafter (main thread)"),
    ("drafter", "worker", "drafter thread"),
)
WORK_COLORS = {
    "verify": STATUS_COLORS["bonus"],
    "draft": STATUS_COLORS["target"],
    "extend": "#a78bfa",
    "wait": STATUS_COLORS["pruned"],
    "probe": STATUS_COLORS["recovered"],
    "branch": STATUS_COLORS["accepted"],
}


def _row(span: PipelineSpan) -> str:
    return next((label for who, thread, label in ROWS if span.who == who and span.thread == thread), span.who)


def timeline_figure(events: list[Event], max_rounds: int = 30) -> go.Figure:
    """Gantt chart of the measured spans of the latest `max_rounds` rounds."""
    title = "Pipeline timeline (measured spans)"
    spans = [e for e in events if isinstance(e, PipelineSpan)]
    if not spans:
        return empty_figure(title, "No timed spans yet")
    first_round = max(s.step for s in spans) - max(1, max_rounds) + 1
    spans = [s for s in spans if s.step >= first_round]
    busy: dict[str, float] = {}
    for s in spans:
        busy[_row(s)] = busy.get(_row(s), 0.0) + s.end - s.start
    summary = ", ".join(f"{row} {seconds:.3f} s" for row, seconds in busy.items())
    fig = go.Figure(layout=base_layout(f"{title}: {summary}", height=300))
    for what in sorted({s.what for s in spans}, key=lambda w: list(WORK_COLORS).index(w) if w in WORK_COLORS else 99):
        chosen = [s for s in spans if s.what == what]
        hovers = [
            f"round {s.step} · {s.what} {plot_text(s.detail)}<br>{_row(s)}<br>"
            f"{s.start * 1000:.1f} to {s.end * 1000:.1f} ms ({(s.end - s.start) * 1000:.1f} ms)"
            for s in chosen
        ]
        bar = go.Bar(
            y=[_row(s) for s in chosen],
            x=[max(s.end - s.start, 1e-6) for s in chosen],
            base=[s.start for s in chosen],
            orientation="h",
            name=what,
            marker={"color": WORK_COLORS.get(what, STATUS_COLORS["target"]), "line": {"width": 0.5, "color": "#fff"}},
            customdata=hovers,
            hovertemplate="%{customdata}<extra></extra>",
        )
        fig.add_trace(bar)
    order = [label for _, _, label in ROWS if label in busy]
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], title_text="")
    fig.update_xaxes(title_text="seconds since the run started")
    fig.update_layout(barmode="overlay", legend={"orientation": "h", "y": -0.3})
    return fig


def _speculation(events: list[Event]) -> list[SpeculationRound]:
    return [e for e in events if isinstance(e, SpeculationRound)]


def _keys_hover(r: SpeculationRound) -> str:
    keys = [f"k={k} {display_token(t)}" for k, t in zip(r.keys_k, r.keys_texts, strict=True)]
    outcome = f"outcome: k={r.accepted}, then {display_token(r.token_text)}"
    verdict = f"hit (rank {r.hit_rank + 1})" if r.hit else "miss"
    cached = ", ".join(keys[:12]) + (" ..." if len(keys) > 12 else "") or "nothing"
    return f"round {r.step}: {verdict}<br>{outcome}<br>cached: {cached}<br>alpha estimate {r.alpha:.3f}"


def cache_figure(events: list[Event]) -> go.Figure:
    """Branches pre-drafted per round and whether the round's actual outcome was cached (hit) or not (miss)."""
    title = "Speculation cache: branches pre-drafted and hits per round"
    rounds = _speculation(events)
    if not rounds:
        return empty_figure(title, "No SSD rounds yet")
    hits = sum(r.hit for r in rounds)
    fig = go.Figure(layout=base_layout(f"{title} ({hits} of {len(rounds)} rounds hit)", height=300))
    xs = [r.step for r in rounds]
    hovers = [_keys_hover(r) for r in rounds]
    bars = go.Bar(x=xs, y=[r.branches for r in rounds], name="branches pre-drafted", marker_color="#cbd5e1")
    fig.add_trace(bars.update(customdata=hovers, hovertemplate="%{customdata}<extra></extra>"))
    for verdict, color, symbol in (
        ("hit", STATUS_COLORS["accepted"], "circle"),
        ("miss", STATUS_COLORS["rejected"], "x"),
    ):
        chosen = [(r, h) for r, h in zip(rounds, hovers, strict=True) if r.hit == (verdict == "hit")]
        marker = go.Scatter(
            x=[r.step for r, _ in chosen],
            y=[r.branches + 0.4 for r, _ in chosen],
            mode="markers",
            name=verdict,
            marker={"color": color, "size": 10, "symbol": symbol},
            customdata=[h for _, h in chosen],
            hovertemplate="%{customdata}<extra></extra>",
        )
        fig.add_trace(marker)
    fig.update_xaxes(title_text="round")
    fig.update_yaxes(title_text="branches", rangemode="tozero")
    fig.update_layout(legend={"orientation": "h", "y": -0.3})
    return fig


def fanout_figure(events: list[Event]) -> go.Figure:
    """Mean guesses pre-drafted and known per position k, with the share of outcomes at each k."""
    title = "Fan-out per position k (guesses: k accepted, then token t)"
    rounds = _speculation(events)
    if not rounds:
        return empty_figure(title, "No SSD rounds yet")
    width = max(len(r.fanout) for r in rounds)
    ks = list(range(width))

    def mean(values: list[list[int]], k: int) -> float:
        return sum(v[k] for v in values if k < len(v)) / len(rounds)

    outcomes = [sum(r.accepted == k for r in rounds) / len(rounds) for k in ks]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(**base_layout(title, height=300))
    planned = go.Bar(x=ks, y=[mean([r.planned for r in rounds], k) for k in ks], name="known (planned)")
    fig.add_trace(planned.update(marker_color="#cbd5e1"), secondary_y=False)
    drafted = go.Bar(x=ks, y=[mean([r.fanout for r in rounds], k) for k in ks], name="pre-drafted")
    fig.add_trace(drafted.update(marker_color=STATUS_COLORS["accepted"]), secondary_y=False)
    share = go.Scatter(x=ks, y=outcomes, mode="lines+markers", name="share of outcomes with this k")
    fig.add_trace(share.update(line={"color": STATUS_COLORS["recovered"], "width": 2}), secondary_y=True)
    fig.update_xaxes(title_text="k (draft tokens accepted)", dtick=1)
    fig.update_yaxes(title_text="guesses per round", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="share of rounds", range=[0, 1.05], secondary_y=True)
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.3})
    return fig


VIEWS: dict[str, StrategyView] = {
    "ssd": StrategyView(
        figures=(
            timeline_figure,
            cache_figure,
            fanout_figure,
            rounds_figure,
            round_detail_figure,
            acceptance_figure,
            speedup_figure,
        ),
        inspect=round_inspect,
    ),
    "speculative": StrategyView(
        figures=(rounds_figure, round_detail_figure, acceptance_figure, speedup_figure, timeline_figure),
        inspect=round_inspect,
    ),
}
