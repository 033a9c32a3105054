"""Mirostat's live views (Basu et al. 2021): the feedback loop drawn from `MirostatStep` events.

Covers three figures, each with an empty state before the first step:
- `control_figure`: mu_t (before the update) and the fed-back surprise S_t per step, with the target tau line;
- `running_mean_figure`: the running mean of the model surprise -log2 p(x) (untruncated, T = 1) per series
  against tau: Mirostat's converges to tau, the comparison replays (series "top-k" / "top-p", `compare`)
  drift where the paper's boredom (low) and confusion (high) traps take them;
- `truncation_figure`: the truncation size k_t per series (v1's k, v2's kept set, top-k's k, the nucleus size),
  on a log axis.
Hover texts carry the step, token id, S, mu, k and s_hat. Not covered: the text itself (the token view shows it).
Imports plotly, the standard library and lab.trace only.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from lab.trace import Event, MirostatStep
from visualizers.style import STATUS_COLORS, base_layout
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

PLACEHOLDER = "No Mirostat steps yet"
SERIES_COLORS = {"mirostat": STATUS_COLORS["bonus"], "top-k": STATUS_COLORS["recovered"], "top-p": "#9467bd"}
MU_COLOR = STATUS_COLORS["accepted"]
TAU_COLOR = STATUS_COLORS["rejected"]
LEGEND = {"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"}


def _steps(events: list[Event]) -> dict[str, list[MirostatStep]]:
    """MirostatStep events grouped by series, Mirostat first, in emission order."""
    grouped: dict[str, list[MirostatStep]] = {}
    for event in events:
        if isinstance(event, MirostatStep):
            grouped.setdefault(event.series, []).append(event)
    return dict(sorted(grouped.items(), key=lambda item: item[0] != "mirostat"))


def _series_name(steps: list[MirostatStep]) -> str:
    first = steps[0]
    return f"mirostat {first.version}" if first.series == "mirostat" else f"{first.series} ({first.version})"


def _hover(event: MirostatStep) -> str:
    mu = "" if event.mu is None else f"<br>mu = {event.mu:.3f} → {event.mu_next:.3f}"
    s_hat = "" if event.s_hat is None else f"<br>s_hat = {event.s_hat:.3f}"
    return (
        f"step {event.step} ({event.series})<br>token id {event.token_id}<br>S fed back = {event.surprise:.3f} bits"
        f"<br>model S = {event.model_surprise:.3f} bits{mu}<br>k = {event.k}{s_hat}"
    )


def _tau_line(fig: go.Figure, tau: float) -> None:
    fig.add_hline(y=tau, line={"color": TAU_COLOR, "dash": "dash", "width": 1.5}, annotation_text=f"tau = {tau:g}")


def control_figure(events: list[Event]) -> go.Figure:
    """mu_t and the fed-back surprise S_t of the Mirostat run over steps, with the target tau."""
    steps = _steps(events).get("mirostat", [])
    title = "Mirostat control: mu and surprise per step"
    if not steps:
        return empty_figure(title, PLACEHOLDER)
    xs = [e.step for e in steps]
    hovers = [_hover(e) for e in steps]
    surprise = go.Scatter(
        x=xs,
        y=[e.surprise for e in steps],
        mode="lines+markers",
        name="S_t (fed back)",
        line={"color": SERIES_COLORS["mirostat"], "width": 1},
        marker={"size": 4},
        customdata=hovers,
        hovertemplate="%{customdata}<extra></extra>",
    )
    mu = go.Scatter(
        x=xs,
        y=[e.mu for e in steps],
        mode="lines",
        name="mu_t (before update)",
        line={"color": MU_COLOR, "width": 2, "shape": "hv"},
        customdata=hovers,
        hovertemplate="%{customdata}<extra></extra>",
    )
    fig = go.Figure([surprise, mu], layout=base_layout(title, height=320))
    _tau_line(fig, steps[0].tau)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="bits")
    fig.update_layout(legend=LEGEND)
    return fig


def running_means(values: list[float]) -> list[float]:
    """Prefix means: out[t] = mean(values[: t + 1])."""
    out, total = [], 0.0
    for t, value in enumerate(values):
        total += value
        out.append(total / (t + 1))
    return out


def running_mean_figure(events: list[Event]) -> go.Figure:
    """Running mean of the model surprise (untruncated, T = 1) per series against the target tau."""
    grouped = _steps(events)
    title = "Running mean surprise vs tau (model S, untruncated)"
    if not grouped:
        return empty_figure(title, PLACEHOLDER)
    traces = []
    for series, steps in grouped.items():
        means = running_means([e.model_surprise for e in steps])
        traces.append(
            go.Scatter(
                x=[e.step for e in steps],
                y=means,
                mode="lines",
                name=_series_name(steps),
                line={"color": SERIES_COLORS.get(series, STATUS_COLORS["target"]), "width": 2},
                customdata=[f"{_hover(e)}<br>running mean = {m:.3f} bits" for e, m in zip(steps, means, strict=True)],
                hovertemplate="%{customdata}<extra></extra>",
            )
        )
    fig = go.Figure(traces, layout=base_layout(title, height=320))
    _tau_line(fig, next(iter(grouped.values()))[0].tau)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="mean -log2 p(x) (bits)")
    fig.update_layout(legend=LEGEND)
    return fig


def truncation_figure(events: list[Event]) -> go.Figure:
    """Truncation size k_t per series (log axis)."""
    grouped = _steps(events)
    title = "Truncation size k per step"
    if not grouped:
        return empty_figure(title, PLACEHOLDER)
    traces = [
        go.Scatter(
            x=[e.step for e in steps],
            y=[e.k for e in steps],
            mode="lines",
            name=_series_name(steps),
            line={"color": SERIES_COLORS.get(series, STATUS_COLORS["target"]), "width": 1.5, "shape": "hv"},
            customdata=[_hover(e) for e in steps],
            hovertemplate="%{customdata}<extra></extra>",
        )
        for series, steps in grouped.items()
    ]
    fig = go.Figure(traces, layout=base_layout(title, height=280))
    fig.update_xaxes(title_text="step")
    kept = [e.k for steps in grouped.values() for e in steps]
    ticks = log_ticks(min(kept), max(kept))
    fig.update_yaxes(
        title_text="tokens kept", type="log", tickmode="array", tickvals=ticks, ticktext=[f"{t:,}" for t in ticks]
    )
    fig.update_layout(legend=LEGEND)
    return fig


def log_ticks(low: int, high: int, most: int = 6) -> list[int]:
    """Tick values for a log axis from `low` to `high`: 1-2-5 steps, or only powers of ten where those would be more
    than `most` (plotly's own log ticks label every digit of a short range, crowding a 280 px figure)."""
    low, high = max(low, 1), max(high, low, 1)
    decades = range(int(math.floor(math.log10(low))), int(math.floor(math.log10(high))) + 1)
    ticks = [m * 10**d for d in decades for m in (1, 2, 5) if low <= m * 10**d <= high]
    if len(ticks) > most:
        ticks = [10**d for d in decades if low <= 10**d <= high]
    return ticks if len(ticks) >= 2 else sorted({low, high, *ticks})


VIEWS = {"mirostat": StrategyView(figures=(control_figure, running_mean_figure, truncation_figure))}
