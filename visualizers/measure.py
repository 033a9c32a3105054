"""The Measure tab's figures, drawn only from measured rows (plain dicts from `lab.tools.measure.measure`).

Covers: `quality_throughput_figure` (x = median tokens/s, y = quality = mean log p_target per output token, one
marker per strategy coloured by family), `acceptance_speedup_figure` (the speculative and multi-token-head rows:
measured acceptance rate alpha against measured speedup over the first row, on the theoretical curves of
Leviathan et al. 2023, Eq. 1 / Thm. 3.8: speedup = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) for each
measured gamma and a few draft costs c), and `selection_matrix_figure` (a table: problem solved, core
operation, measured speed, when to use it; the texts come from the caller, e.g. `lab.app.learn`).
A row without a value (no acceptance rate, no quality) is left out of that figure. Pure plotly.
"""

from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from visualizers.style import STATUS_COLORS, base_layout
from visualizers.topk import empty_figure

FAMILY_COLORS = {
    "baseline": STATUS_COLORS["target"],
    "logit-level": "#7c3aed",
    "speculative": STATUS_COLORS["accepted"],
    "multi-token heads": STATUS_COLORS["bonus"],
    "system 2": STATUS_COLORS["recovered"],
}
DRAFT_COSTS = (0.0, 0.1, 0.25)
CURVE_POINTS = 60


def expected_speedup(alpha: float, gamma: int, cost: float) -> float:
    """(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); the alpha -> 1 limit is (gamma + 1) / (gamma c + 1)."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * cost + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * cost + 1))


def quality_throughput_figure(rows: list[dict]) -> go.Figure:
    """Tokens/s against quality, one labelled marker per measured strategy."""
    points = [r for r in rows if r.get("quality") is not None and r.get("tokens_per_s") is not None]
    title = "Quality vs throughput (measured)"
    if not points:
        return empty_figure(title, "Run the benchmark first")
    fig = go.Figure(layout=base_layout(title, 420))
    for family in dict.fromkeys(r["family"] for r in points):
        group = [r for r in points if r["family"] == family]
        fig.add_trace(
            go.Scatter(
                x=[r["tokens_per_s"] for r in group],
                y=[r["quality"] for r in group],
                text=[r["name"] for r in group],
                mode="markers+text",
                textposition="top center",
                name=family,
                marker={"size": 13, "color": FAMILY_COLORS.get(family, STATUS_COLORS["target"])},
                hovertemplate="%{text}<br>%{x:.2f} tok/s<br>log p = %{y:.3f} nats/token<extra></extra>",
            )
        )
    fig.update_xaxes(title_text="median tokens/s (higher is faster)")
    fig.update_yaxes(title_text="mean log p_target per token (nats)")
    return fig


def _curve(gamma: int, cost: float) -> go.Scatter:
    alphas = [i / CURVE_POINTS for i in range(CURVE_POINTS)] + [0.995]
    return go.Scatter(
        x=alphas,
        y=[expected_speedup(a, gamma, cost) for a in alphas],
        mode="lines",
        name=f"theory γ={gamma}, c={cost:g}",
        line={"width": 1.5, "dash": "solid" if cost == 0 else "dot"},
        hovertemplate=f"γ={gamma}, c={cost:g}<br>α=%{{x:.2f}}<br>speedup %{{y:.2f}}x<extra></extra>",
    )


def acceptance_speedup_figure(rows: list[dict]) -> go.Figure:
    """Measured (alpha, speedup) of every row with an acceptance rate, over the theoretical curves."""
    points = [r for r in rows if r.get("acceptance_rate") is not None and r.get("speedup") is not None]
    title = "Acceptance rate vs speedup (points measured, lines theory)"
    if not points:
        return empty_figure(title, "No speculative strategy was measured")
    fig = go.Figure(layout=base_layout(title, 440))
    for gamma in sorted({r["gamma"] for r in points if r.get("gamma")}):
        for cost in DRAFT_COSTS:
            fig.add_trace(_curve(gamma, cost))
    fig.add_trace(
        go.Scatter(
            x=[r["acceptance_rate"] for r in points],
            y=[r["speedup"] for r in points],
            text=[r["name"] for r in points],
            customdata=[[r.get("gamma") or "tree", r.get("mean_accepted_length") or 0] for r in points],
            mode="markers+text",
            textposition="top center",
            name="measured",
            marker={"size": 14, "color": STATUS_COLORS["accepted"], "line": {"width": 1, "color": "#0f172a"}},
            hovertemplate="%{text}<br>α=%{x:.3f}<br>speedup %{y:.2f}x<br>γ=%{customdata[0]}, τ=%{customdata[1]:.2f}"
            "<extra></extra>",
        )
    )
    fig.add_hline(y=1.0, line={"color": "#94a3b8", "width": 1})
    fig.update_xaxes(title_text="acceptance rate α", range=[0, 1])
    fig.update_yaxes(title_text="speedup over the first row (measured wall time)", rangemode="tozero")
    return fig


def _speed_cell(row: dict) -> str:
    text = f"{row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x)"
    if row.get("acceptance_rate") is not None:
        text += f", α={row['acceptance_rate']:.2f}"
    return text


def _wrap(text: str, width: int) -> str:
    """Break a cell's text into lines of about `width` characters (plotly tables do not wrap); CJK text, which
    is cut every width // 2 characters (about the same width)."""
    if any(ord(ch) >= 0x2E80 for ch in text):
        step = max(width // 2, 1)
        return "<br>".join(text[i : i + step] for i in range(0, len(text), step))
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False)) or text


def selection_matrix_figure(rows: list[dict], cells: dict[str, tuple[str, str, str]], headings: tuple) -> go.Figure:
    """A table per measured strategy: family, problem solved, core operation, measured speed, when to use it."""
    title = "Selection matrix"
    if not rows:
        return empty_figure(title, "Run the benchmark first")
    problem, operation, when = headings
    columns = ["strategy", "family", problem, operation, "measured", when]
    widths = (12, 12, 24, 26, 22, 44)
    body = [
        [r["name"] for r in rows],
        [r["family"] for r in rows],
        [cells.get(r["name"], ("", "", ""))[0] for r in rows],
        [cells.get(r["name"], ("", "", ""))[1] for r in rows],
        [_speed_cell(r) for r in rows],
        [cells.get(r["name"], ("", "", ""))[2] for r in rows],
    ]
    body = [[_wrap(str(cell), width) for cell in column] for column, width in zip(body, widths, strict=True)]
    lines = max((cell.count("<br>") + 1 for column in body for cell in column), default=1)
    table = go.Table(
        columnwidth=list(widths),
        header={"values": columns, "fill_color": "#e2e8f0", "align": "left", "font": {"size": 12}},
        cells={"values": body, "align": "left", "height": 16 * lines + 10, "font": {"size": 11}},
    )
    layout = base_layout(title, 140 + (16 * lines + 22) * len(rows))
    layout["margin"] = {"l": 8, "r": 8, "t": 40, "b": 8}
    return go.Figure(table, layout=layout)
