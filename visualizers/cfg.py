"""Live views of classifier-free guidance (Sanchez et al. 2023, Eq. 7) from `GuidanceStep` events.

Covers: `guidance_bars_figure` (latest step: grouped bars of the cond, uncond and guided probabilities of the
stored tokens, full-vocabulary values), `guidance_delta_figure` (latest step: log P(x|c) - log P(x|uncond) per
token, the direction guidance pushes), `guidance_trace_figure` (over steps: entropies of cond, uncond and guided
and KL(guided || cond), in nats), `guidance_step_figure(events, step, gamma)` (one step re-weighted at another
gamma from the stored log-probs, no model: renormalized over the stored subset, which the figure says), and
`guidance_changed_steps` (steps where guidance changed the top token, for the token view).
Not covered: re-running the model at another gamma (later tokens would change too; this view cannot show that).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from lab.trace import Event, GuidanceStep
from visualizers.style import STATUS_COLORS, base_layout, display_token, distinct_labels
from visualizers.topk import empty_figure
from visualizers.view import StrategyView

SERIES_COLORS = {"cond": "#1f77b4", "uncond": "#9e9e9e", "guided": "#9467bd", "kl": "#ff7f0e"}
PLACEHOLDER = "No guidance steps yet"
LEGEND_ABOVE = {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"}


def guidance_steps(events: list[Event]) -> list[GuidanceStep]:
    return [e for e in events if isinstance(e, GuidanceStep)]


def _labels(event: GuidanceStep) -> list[str]:
    return distinct_labels([display_token(t) for t in event.tokens])


def _bar(name: str, labels: list[str], values: list[float], hovers: list[str], **style) -> go.Bar:
    return go.Bar(
        name=name,
        x=labels,
        y=values,
        marker={"color": SERIES_COLORS[name.split(" ")[0]], **style},
        customdata=hovers,
        hovertemplate="%{customdata}<extra>" + name + "</extra>",
    )


def _hovers(event: GuidanceStep, labels: list[str], values: list[float], what: str) -> list[str]:
    return [f"step {event.step}<br>token {label}<br>{what} = {v:.4g}" for label, v in zip(labels, values, strict=True)]


def _mark_emitted(fig: go.Figure, event: GuidanceStep, labels: list[str], heights: list[list[float]]) -> None:
    """A small arrow above the emitted token's bars when it is among the stored tokens."""
    if event.token_id in event.token_ids:
        i = event.token_ids.index(event.token_id)
        top = max(series[i] for series in heights)
        fig.add_annotation(x=labels[i], y=top, text="emitted", showarrow=True, arrowhead=2, ay=-18, yshift=2)


def guidance_bars_figure(events: list[Event]) -> go.Figure:
    """Latest step: P(x|c), P(x|uncond) and P_hat(x) for the union of their top-8 (full-vocabulary values)."""
    steps = guidance_steps(events)
    if not steps:
        return empty_figure("CFG: cond / uncond / guided probabilities", PLACEHOLDER)
    event = steps[-1]
    labels = _labels(event)
    series = {
        "cond": [math.exp(v) for v in event.cond_logprobs],
        "uncond": [math.exp(v) for v in event.uncond_logprobs],
        "guided": event.guided_probs,
    }
    bars = [_bar(name, labels, ys, _hovers(event, labels, ys, f"P_{name}")) for name, ys in series.items()]
    title = f"CFG step {event.step}: P(x|cond), P(x|uncond), guided P_hat (gamma = {event.gamma:g})"
    fig = go.Figure(bars, layout=base_layout(title, height=320))
    fig.update_layout(barmode="group", legend=LEGEND_ABOVE, margin_t=72)
    fig.update_yaxes(title_text="probability", rangemode="tozero")
    _mark_emitted(fig, event, labels, list(series.values()))
    return fig


def guidance_delta_figure(events: list[Event]) -> go.Figure:
    """Latest step: log P(x|c) - log P(x|uncond) per stored token (> 0: the prompt favours it, guidance boosts it)."""
    steps = guidance_steps(events)
    if not steps:
        return empty_figure("CFG: log P(x|cond) - log P(x|uncond)", PLACEHOLDER)
    event = steps[-1]
    labels = _labels(event)
    deltas = [c - u for c, u in zip(event.cond_logprobs, event.uncond_logprobs, strict=True)]
    hovers = [
        f"step {event.step}<br>token {label}<br>log P_c = {c:.3f}<br>log P_u = {u:.3f}<br>delta = {d:+.3f}"
        for label, c, u, d in zip(labels, event.cond_logprobs, event.uncond_logprobs, deltas, strict=True)
    ]
    colors = [STATUS_COLORS["accepted"] if d >= 0 else STATUS_COLORS["rejected"] for d in deltas]
    bar = go.Bar(
        x=labels, y=deltas, marker={"color": colors}, customdata=hovers, hovertemplate="%{customdata}<extra></extra>"
    )
    title = f"CFG step {event.step}: log P(x|cond) - log P(x|uncond) (guidance adds (gamma - 1) x this)"
    fig = go.Figure([bar], layout=base_layout(title, height=280))
    fig.update_yaxes(title_text="log-prob difference (nats)", zeroline=True)
    fig.update_layout(showlegend=False)
    return fig


def guidance_trace_figure(events: list[Event]) -> go.Figure:
    """Over steps: entropy of cond, uncond and guided, and KL(guided || cond), all in nats (full vocabulary)."""
    steps = guidance_steps(events)
    if not steps:
        return empty_figure("CFG: entropy and KL per step", PLACEHOLDER)
    xs = [e.step for e in steps]
    lines = {
        "cond": [e.entropy_cond for e in steps],
        "uncond": [e.entropy_uncond for e in steps],
        "guided": [e.entropy_guided for e in steps],
    }
    traces = [
        go.Scatter(x=xs, y=ys, mode="lines+markers", name=f"H({name})", line={"color": SERIES_COLORS[name]})
        for name, ys in lines.items()
    ]
    kl = [e.kl_guided_cond for e in steps]
    dash = {"color": SERIES_COLORS["kl"], "dash": "dash"}
    traces.append(go.Scatter(x=xs, y=kl, mode="lines+markers", name="KL(guided || cond)", line=dash))
    fig = go.Figure(traces, layout=base_layout("CFG: entropy and KL(guided || cond) per step (nats)", height=280))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="nats", rangemode="tozero")
    fig.update_layout(hovermode="x unified", legend=LEGEND_ABOVE, margin_t=72)
    return fig


def _softmax(scores: list[float]) -> list[float]:
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def reweighted_probs(event: GuidanceStep, gamma: float) -> list[float]:
    """Sanchez et al. 2023, Eq. 7 on the stored subset: softmax over it of log P_u + gamma (log P_c - log P_u)."""
    pairs = zip(event.cond_logprobs, event.uncond_logprobs, strict=True)
    return _softmax([gamma * (c - u) + u for c, u in pairs])


def guidance_step_figure(events: list[Event], step: int, gamma: float) -> go.Figure:
    """Step `step` re-weighted at `gamma` from the stored log-probs (no model), renormalized over the stored
    tokens; the recorded guided distribution (at the run's gamma, renormalized the same way) is overlaid."""
    event = next((e for e in guidance_steps(events) if e.step == step), None)
    if event is None:
        return empty_figure("CFG: re-weight one step", f"No guidance event for step {step}")
    labels = _labels(event)
    total = sum(event.guided_probs) or 1.0  # > 0 in practice: the guided argmax is always stored
    recorded = [p / total for p in event.guided_probs]
    series = {
        "cond": _softmax(event.cond_logprobs),
        "uncond": _softmax(event.uncond_logprobs),
        f"guided (gamma = {gamma:g})": reweighted_probs(event, gamma),
    }
    traces: list = [
        _bar(name, labels, ys, _hovers(event, labels, ys, "p (renormalized)")) for name, ys in series.items()
    ]
    traces.append(
        go.Scatter(
            x=labels,
            y=recorded,
            mode="markers",
            name=f"recorded guided (run gamma = {event.gamma:g})",
            marker={"symbol": "diamond-open", "size": 10, "color": "#0f172a", "line": {"width": 2}},
            customdata=_hovers(event, labels, recorded, "p (renormalized)"),
            hovertemplate="%{customdata}<extra>recorded</extra>",
        )
    )
    title = (
        f"CFG step {step} re-weighted at gamma = {gamma:g}: renormalized over the "
        f"{len(event.token_ids)} stored tokens (no model re-run)"
    )
    fig = go.Figure(traces, layout=base_layout(title, height=340))
    fig.update_layout(barmode="group", legend=LEGEND_ABOVE, margin_t=72)
    fig.update_yaxes(title_text="probability within the subset", rangemode="tozero")
    _mark_emitted(fig, event, labels, [*series.values(), recorded])
    return fig


def guidance_changed_steps(events: list[Event]) -> set[int]:
    """Steps where the guided top token differs from the conditional top token (both are in the stored union)."""
    changed = set()
    for e in guidance_steps(events):
        top_cond = max(range(len(e.token_ids)), key=lambda i: e.cond_logprobs[i])
        top_guided = max(range(len(e.token_ids)), key=lambda i: e.guided_probs[i])
        if e.token_ids[top_cond] != e.token_ids[top_guided]:
            changed.add(e.step)
    return changed


VIEWS = {
    "cfg": StrategyView(
        figures=(guidance_bars_figure, guidance_delta_figure, guidance_trace_figure),
        highlight_steps=guidance_changed_steps,
        highlight_label="guidance changed the top token",
        inspect=guidance_step_figure,
        knobs=("gamma",),
    ),
}
