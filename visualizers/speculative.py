"""Speculative decoding's live views (Leviathan et al. 2023), drawn from `DraftRound` events.

Covers four figures, each with an empty state before the first round:
- `rounds_figure`: the draft strip, one row per round (the latest `max_rounds`), one cell per drafted token
  coloured accepted / rejected / not verified (after a rejection), and a last cell with the target's own token
  (recovered after a rejection, or the bonus after a fully accepted draft); one trace per status (legend
  toggles them), hover text with p(x), q(x) and u;
- `round_detail_figure(events, round_index)`: one round (default the latest): q(x_i) and p(x_i) bars per drafted
  token with u_i against the acceptance ratio min(1, p/q) (x_i is kept iff u_i < ratio; hover lists the top
  alternatives with p and q), and the residual norm(max(0, p - q)) the recovered token was drawn from;
  `round_inspect(events, step)` is the same figure for the round of a step (for the app's inspector);
- `acceptance_figure`: the running acceptance rate alpha = accepted / examined draft tokens and the running mean
  accepted length (tokens per round, recovered or bonus included) over rounds, with each round's count;
- `speedup_figure`: Leviathan et al. 2023, Eq. 1 / Thm. 3.8, speedup(gamma) = (1 - alpha^(gamma+1)) /
  ((1 - alpha)(gamma c + 1)) for gamma = 1..10 with the measured alpha and cost ratio c = (draft seconds per
  drafted token) / (seconds per verify forward), the c = 0 curve (a free drafter), and the run's measured
  point: tokens per round x t_verify / (t_draft + t_verify), i.e. counting one verify forward as one target
  step exactly as the formula does. It is not a wall-clock speedup against greedy (a verify of gamma + 1 tokens
  costs somewhat more than one step); `python -m lab bench` measures that.
Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.trace import DraftRound, Event
from visualizers.labels import NARROW_PLOT_PX, PlotBox, fit_labels
from visualizers.style import STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

PLACEHOLDER = "No speculative rounds yet"
UNVERIFIED = "not verified"
STRIP_STATUSES = ("accepted", "rejected", UNVERIFIED, "recovered", "bonus")
GAMMAS = list(range(1, 11))


def _shown(text: str) -> str:
    """A token for plotly text: whitespace made visible, <, > and & escaped (plotly decodes those entities but
    shows &quot; and &#x27; literally, so quotes stay as they are)."""
    return html.escape(display_token(text, escape=False), quote=False)


def _rounds(events: list[Event]) -> list[DraftRound]:
    return [e for e in events if isinstance(e, DraftRound)]


def _color(status: str) -> str:
    return STATUS_COLORS["pruned"] if status == UNVERIFIED else STATUS_COLORS[status]


def _draft_status(r: DraftRound, i: int) -> str:
    if i < r.accepted:
        return "accepted"
    return "rejected" if i == r.accepted and r.recovered is not None else UNVERIFIED


def _cells(rounds: list[DraftRound]) -> dict[str, list[tuple[int, int, str, str]]]:
    """Per status: (position, round step, label, hover) of every strip cell."""
    cells: dict[str, list[tuple[int, int, str, str]]] = {s: [] for s in STRIP_STATUSES}
    for r in rounds:
        for i, (text, p, q) in enumerate(zip(r.draft_texts, r.p, r.q, strict=True)):
            status = _draft_status(r, i)
            u = f", u = {r.uniforms[i]:.3f}" if i < len(r.uniforms) else ""
            hover = f"round {r.step} · position {i + 1}<br>{_shown(text)} {status}<br>p = {p:.4f}, q = {q:.4f}{u}"
            cells[status].append((i + 1, r.step, _shown(text), hover))
        final = "recovered" if r.recovered is not None else "bonus" if r.bonus is not None else None
        if final:
            where = f"replaces draft position {r.accepted + 1}" if final == "recovered" else "after a full draft"
            hover = f"round {r.step} · {final} {_shown(r.final_text)}<br>{where}"
            cells[final].append((len(r.draft_tokens) + 1, r.step, _shown(r.final_text), hover))
    return cells


def rounds_figure(events: list[Event], max_rounds: int = 24) -> go.Figure:
    """The draft strip of the latest `max_rounds` rounds: rows = rounds, cells = drafted tokens by status,
    then the target's own token (recovered or bonus) in the cell after the draft."""
    title = "Draft rounds: accepted / rejected / recovered / bonus"
    rounds = _rounds(events)[-max(1, max_rounds) :]
    if not rounds:
        return empty_figure(title, PLACEHOLDER)
    cells = _cells(rounds)
    height = max(260, 110 + 28 * len(rounds))
    items = [c for s in STRIP_STATUSES for c in cells[s]]
    width = max(c[0] for c in items)
    steps = [r.step for r in rounds]
    box = PlotBox(NARROW_PLOT_PX, height - 44 - 66, (0.5, width + 0.5), (-(max(steps) + 0.5), -(min(steps) - 0.5)))
    points = [(c[0], -c[1]) for c in items]  # the y axis is reversed: round r drawn at -r
    cell_px = NARROW_PLOT_PX / width
    fitted = fit_labels(points, [c[2] for c in items], box, anchor="center", max_px=cell_px - 4, font=10)
    labels = fitted
    fig = go.Figure(layout=base_layout(title, height=height))
    offset = 0
    for status in STRIP_STATUSES:
        items = cells[status]
        fig.add_trace(
            go.Scatter(
                x=[c[0] for c in items],
                y=[c[1] for c in items],
                mode="markers+text",
                name=status,
                text=labels[offset : offset + len(items)],
                textfont={"size": 10},
                marker={"symbol": "square", "size": 24, "color": _color(status), "opacity": 0.35},
                customdata=[c[3] for c in items],
                hovertemplate="%{customdata}<extra></extra>",
            )
        )
        offset += len(items)
    x_title = "position in round (last cell: the target's token)"
    fig.update_xaxes(title_text=x_title, dtick=1, zeroline=False, range=[0.5, width + 0.5])
    fig.update_yaxes(title_text="round", range=[max(steps) + 0.5, min(steps) - 0.5], dtick=1, zeroline=False)
    fig.update_layout(legend={"orientation": "h", "y": -0.15}, margin={"b": 66})
    return fig


def _round_at(events: list[Event], round_index: int) -> DraftRound | None:
    rounds = _rounds(events)
    return rounds[round_index] if -len(rounds) <= round_index < len(rounds) else None


def _alternatives_hover(r: DraftRound, i: int) -> str:
    rows = zip(r.alt_texts[i], r.alt_p[i], r.alt_q[i], strict=True) if i < len(r.alt_texts) else []
    lines = [f"{_shown(t)}: p = {p:.4f}, q = {q:.4f}" for t, p, q in rows]
    return f"position {i + 1}: {_shown(r.draft_texts[i])} ({_draft_status(r, i)})<br>" + "<br>".join(lines)


def _detail_title(r: DraftRound) -> str:
    end = f"recovered {_shown(r.final_text)}" if r.recovered is not None else ""
    end = end or (f"bonus {_shown(r.final_text)}" if r.bonus is not None else "no final token")
    return f"Round {r.step} ({r.drafter}): {len(r.draft_tokens)} drafted, {r.accepted} accepted, {end}"


def round_detail_figure(events: list[Event], round_index: int = -1) -> go.Figure:
    """q(x_i) vs p(x_i) per drafted token with u_i against min(1, p/q), and the residual of a rejection."""
    r = _round_at(events, round_index)
    if r is None:
        return empty_figure("Round detail: q vs p", PLACEHOLDER)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32], subplot_titles=("q vs p", "residual"))
    fig.update_layout(**base_layout(_detail_title(r), height=360))
    xs = distinct_labels([f"{i + 1}: {_shown(t)}" for i, t in enumerate(r.draft_texts)])
    hovers = [_alternatives_hover(r, i) for i in range(len(xs))]
    for name, values, color in (("q(x)", r.q, STATUS_COLORS["target"]), ("p(x)", r.p, STATUS_COLORS["bonus"])):
        bar = go.Bar(x=xs, y=values, name=name, marker_color=color, customdata=hovers, hovertemplate="%{customdata}")
        fig.add_trace(bar, row=1, col=1)
    ratios = [min(1.0, p / q) if q > 0 else 1.0 for p, q in zip(r.p, r.q, strict=True)][: len(r.uniforms)]
    fig.add_trace(_marker(xs, ratios, "min(1, p/q)", "line-ew-open", "#0f172a"), row=1, col=1)
    colors = [_color(_draft_status(r, i)) for i in range(len(r.uniforms))]
    fig.add_trace(_marker(xs, r.uniforms, "u (kept iff u < ratio)", "diamond", colors), row=1, col=1)
    if r.residual_top_probs:
        labels = distinct_labels([_shown(t) for t in r.residual_top_texts])
        colors = [
            STATUS_COLORS["recovered"] if i == r.recovered else STATUS_COLORS["pruned"] for i in r.residual_top_ids
        ]
        bar = go.Bar(x=labels, y=r.residual_top_probs, name="norm(max(0, p - q))", marker_color=colors)
        fig.add_trace(bar, row=1, col=2)
    else:
        note = "no rejection: bonus drawn from p" if r.bonus is not None else "no rejection"
        fig.add_annotation(text=note, x=0.5, y=0.5, xref="x2 domain", yref="y2 domain", showarrow=False)
    fig.update_yaxes(range=[0, 1.05], title_text="probability", row=1, col=1)
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.25}, margin={"t": 72})
    return fig


def _marker(xs: list[str], ys: list[float], name: str, symbol: str, color: str | list[str]) -> go.Scatter:
    return go.Scatter(
        x=xs[: len(ys)],
        y=ys,
        mode="markers",
        name=name,
        marker={"symbol": symbol, "size": 14, "color": color, "line": {"width": 2, "color": "#0f172a"}},
        hovertemplate=f"{name} = %{{y:.4f}}<extra></extra>",
    )


def round_inspect(events: list[Event], step: int, **_knobs: float) -> go.Figure:
    """The round detail of the round that emitted the tokens of `step` (StrategyView.inspect)."""
    index = next((i for i, r in enumerate(_rounds(events)) if r.step == step), None)
    if index is None:
        return empty_figure(f"Round {step}", f"No speculative round at step {step}")
    return round_detail_figure(events, index)


def running_stats(rounds: list[DraftRound]) -> tuple[list[float | None], list[float]]:
    """Running acceptance rate (accepted / examined, None until a draft token was examined) and running mean
    tokens per round (accepted + the recovered or bonus token), the folds of `lab.trace.summarize`."""
    accepted = examined = emitted = 0
    alphas: list[float | None] = []
    lengths: list[float] = []
    for n, r in enumerate(rounds, start=1):
        accepted += r.accepted
        examined += r.accepted + (r.recovered is not None)
        emitted += r.accepted + (r.recovered is not None or r.bonus is not None)
        alphas.append(accepted / examined if examined else None)
        lengths.append(emitted / n)
    return alphas, lengths


def acceptance_figure(events: list[Event]) -> go.Figure:
    """Running alpha and running mean accepted length over rounds, with each round's accepted count."""
    title = "Acceptance over rounds"
    rounds = _rounds(events)
    if not rounds:
        return empty_figure(title, PLACEHOLDER)
    alphas, lengths = running_stats(rounds)
    xs = [r.step for r in rounds]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(**base_layout(title, height=300))
    counts = go.Bar(x=xs, y=[r.accepted for r in rounds], name="accepted in round", marker_color="#cbd5e1", opacity=0.6)
    fig.add_trace(counts, secondary_y=True)
    fig.add_trace(_line(xs, lengths, "mean accepted length (tokens / round)", STATUS_COLORS["bonus"]), secondary_y=True)
    fig.add_trace(_line(xs, alphas, "acceptance rate alpha", STATUS_COLORS["accepted"]), secondary_y=False)
    fig.update_yaxes(title_text="alpha", range=[0, 1.05], secondary_y=False)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", secondary_y=True)
    fig.update_xaxes(title_text="round")
    fig.update_layout(legend={"orientation": "h", "y": -0.25})
    return fig


def _line(xs: list[int], ys: list, name: str, color: str, dash: str = "solid") -> go.Scatter:
    return go.Scatter(x=xs, y=ys, mode="lines", name=name, line={"color": color, "width": 2, "dash": dash})


def theoretical_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. 2023, Thm. 3.8: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); alpha = 1 is the
    limit (gamma + 1) / (gamma c + 1)."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def measured_costs(rounds: list[DraftRound]) -> tuple[float, float, float]:
    """(c, measured speedup, mean gamma): c = draft seconds per drafted token / mean verify seconds; the
    measured speedup = tokens per round x mean t_verify / mean (t_draft + t_verify)."""
    drafted = sum(len(r.draft_tokens) for r in rounds)
    verify = sum(r.verify_s for r in rounds) / len(rounds)
    draft = sum(r.draft_s for r in rounds)
    c = (draft / drafted) / verify if drafted and verify > 0 else 0.0
    _, lengths = running_stats(rounds)
    total = (draft / len(rounds)) + verify
    speedup = lengths[-1] * verify / total if total > 0 else 0.0
    return c, speedup, drafted / len(rounds)


def speedup_figure(events: list[Event]) -> go.Figure:
    """Theoretical speedup over gamma with the measured alpha and c, the c = 0 curve, and the measured point."""
    title = "Expected speedup vs gamma (Leviathan et al. 2023, Thm. 3.8)"
    rounds = _rounds(events)
    alphas, _ = running_stats(rounds) if rounds else ([], [])
    alpha = alphas[-1] if alphas else None
    if alpha is None:
        return empty_figure(title, "No verified draft tokens yet")
    c, measured, mean_gamma = measured_costs(rounds)
    fig = go.Figure(layout=base_layout(f"{title}: alpha = {alpha:.3f}, c = {c:.3f}", height=320))
    curve = [theoretical_speedup(alpha, g, c) for g in GAMMAS]
    fig.add_trace(_line(GAMMAS, curve, f"theory, measured c = {c:.3f}", STATUS_COLORS["bonus"]))
    free = [theoretical_speedup(alpha, g, 0.0) for g in GAMMAS]
    fig.add_trace(_line(GAMMAS, free, "theory, c = 0 (free drafter)", STATUS_COLORS["pruned"], "dash"))
    point = go.Scatter(
        x=[mean_gamma],
        y=[measured],
        mode="markers",
        name="measured: tokens/round x t_verify / (t_draft + t_verify)",
        marker={"size": 13, "color": STATUS_COLORS["recovered"], "symbol": "star"},
        hovertemplate=f"mean drafted per round {mean_gamma:.2f}<br>measured {measured:.3f}x<extra></extra>",
    )
    fig.add_trace(point)
    fig.add_hline(y=1.0, line={"color": "#94a3b8", "width": 1})
    fig.update_xaxes(title_text="gamma (draft length)", dtick=1)
    fig.update_yaxes(title_text="speedup (x)", rangemode="tozero")
    fig.update_layout(legend={"orientation": "h", "y": -0.3})
    return fig


VIEWS = {
    "speculative": StrategyView(
        figures=(rounds_figure, round_detail_figure, acceptance_figure, speedup_figure), inspect=round_inspect
    ),
}
